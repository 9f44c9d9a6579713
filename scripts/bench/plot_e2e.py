"""Per-phase time of one GRPO step, ours (native and vLLM rollout) versus TRL's GRPOTrainer: the fixed workload
(scripts/bench/results/e2e_h200.json) and the long-tailed one at 0.5B
(e2e_h200_long_tail_1024_0_5b_vllm_rows.json, with TRL `generate` from e2e_h200_long_tail_1024_0_5b.json, and
verl 0.9.1's steady step by phase from verl_h200_long_tail_1024_0_5b.json next to ours measured the same day,
e2e_h200_long_tail_1024_0_5b_verlcall.json), and the long-tailed one at 1.5B to 4,096 tokens against TRL with
colocated vLLM (e2e_h200_long_tail_4096_1_5b.json; ours again after the Triton draw,
e2e_h200_long_tail_4096_1_5b_sampler.json, and after the inverse-CDF draw and flash prefill,
e2e_h200_long_tail_4096_1_5b_flash_prefill.json, and after the RMSNorm kernels,
e2e_h200_long_tail_4096_1_5b_rmsnorm.json, and at 613a159, e2e_h200_long_tail_4096_1_5b_sourced.json); the
fixed panel adds the 613a159 call's runs (e2e_h200_fixed_{0_5b,1_5b}_sourced.json), the trainer's default
micro-batches, ours and TRL measured in one call at b453d9a, and whole rows against each group's prompt once
(trainer.share_prompts) at 90399ed, also at the long tails. The long-tail panels mark
the issue's tight limit of the step (roofline.py: generation at the decode roofline + update at 70% MFU).

pip install matplotlib && python scripts/bench/plot_e2e.py   # writes scripts/bench/results/e2e_h200.png
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from roofline import step_bound  # noqa: E402
from workload import response_lengths  # noqa: E402

HERE = os.path.join(os.path.dirname(__file__), "results")
PHASES = (("gen", "rollout (gen)"), ("update_actor", "actor update"), ("other", "reward, adv, reshard"))
VERL_PHASES = (
    ("gen", "timing_s/gen"),
    ("old_log_prob", "timing_s/old_log_prob"),
    ("update_actor", "timing_s/update_actor"),
)


def fastest(runs: list[dict], backend: str) -> dict[str, dict]:
    """Per preset, the run of `backend` with the fewest GPU-seconds per step."""
    best: dict[str, dict] = {}
    for r in runs:
        if "ours" in r and r["ours"].get("backend") == backend and "step_s" in r["ours"]:
            cur = best.get(r["preset"])
            if cur is None or r["ours"]["step_s"] * r["gpus"] < cur["ours"]["step_s"] * cur["gpus"]:
                best[r["preset"]] = r
    return best


COLORS = {"gen": "#4c72b0", "update_actor": "#dd8452", "other": "#8c8c8c", "old_log_prob": "#c44e52"}
TRL_COLORS = {"generate": "#55a868", "vllm": "#8172b3"}


def ours_bar(ax, x: int, run: dict, legend_done: set) -> None:
    """One stacked bar of ours: rollout, actor update and the rest, in GPU-seconds per step."""
    t, gpus = run["ours"]["timing"], run["gpus"]
    parts = {"gen": t["gen"], "update_actor": t["update_actor"]}
    parts["other"] = t["step"] - parts["gen"] - parts["update_actor"]
    bottom = 0.0
    for key, name in PHASES:
        ax.bar(
            x, parts[key] * gpus, bottom=bottom, color=COLORS[key], label=None if key in legend_done else name
        )
        legend_done.add(key)
        bottom += parts[key] * gpus
    ax.text(x, bottom + 0.5, f"{bottom:.1f}", ha="center", fontsize=8)


def trl_bar(ax, x: int, run: dict, legend_done: set) -> None:
    """TRL's whole step (one GPU), colored by its generation engine."""
    engine = run.get("engine", "generate")
    key = f"trl_{engine}"
    label = None if key in legend_done else f"TRL, {engine} (whole step)"
    legend_done.add(key)
    ax.bar(x, run["step_s"], color=TRL_COLORS[engine], label=label)
    ax.text(x, run["step_s"] + 0.5, f"{run['step_s']:.1f}", ha="center", fontsize=8)


def verl_bar(ax, x: int, run: dict, legend_done: set) -> None:
    """verl's last finished step (one GPU) by phase: generation, old log-probs, actor update, the rest."""
    last = run["timing_s"][str(max(int(k) for k in run["timing_s"]))]
    parts = {key: last[name] for key, name in VERL_PHASES}
    parts["other"] = last["timing_s/step"] - sum(parts.values())
    bottom = 0.0
    for key in ("gen", "old_log_prob", "update_actor", "other"):
        label = None if key in legend_done else {"old_log_prob": "old log-probs (verl)"}.get(key, key)
        legend_done.add(key)
        ax.bar(x, parts[key], bottom=bottom, color=COLORS[key], label=label)
        bottom += parts[key]
    ax.text(x, bottom + 0.5, f"{bottom:.1f}", ha="center", fontsize=8)


def tight_limit(ax, run: dict, x0: float, x1: float) -> None:
    """A dashed segment over bars x0..x1 at the issue's tight limit of `run`'s workload (an e2e.py report)."""
    lengths = response_lengths(
        run["lengths"]["kind"], run["prompts"], run["response_len"], run["lengths"]["seed"]
    )
    bound = step_bound(run["preset"], run["prompts"], run["n"], run["prompt_len"], lengths, run["gpus"])
    label = f"the issue's tight limit ({bound['seconds']:.1f} s: roofline.py)"
    ax.hlines(bound["seconds"], x0 - 0.45, x1 + 0.45, colors="black", linestyles="dashed", label=label)


def later_fixed_runs(preset: str) -> list[tuple[str, dict]]:
    """The latest tree's fixed-workload runs (e2e_h200_fixed_<size>_sourced.json: commit 613a159, each run of
    that call, not only the fastest), as (label, e2e.py report)."""
    path = os.path.join(HERE, f"e2e_h200_fixed_{preset.removeprefix('qwen2_5_')}_sourced.json")
    if not os.path.exists(path):
        return []
    runs = json.load(open(path))
    return [
        (k.replace("sourced_", "").replace("_", ", "), r) for k, r in runs.items() if k.startswith("sourced")
    ]


def default_fixed_runs(preset: str) -> list[tuple[str, dict]]:
    """The trainer's default micro-batches (8 rows at the batch's width, no token budget) eager and with the
    layers' CUDA graphs, the default since 979bb6f (e2e_h200_fixed_<size>_8_rows_auto_graphs_{eager,null}.json,
    one call), as (label, e2e.py report)."""
    size = preset.removeprefix("qwen2_5_")
    labels = {"eager": "8 rows, eager", "null": "8 rows, graphs\n(the default)"}
    return labelled_runs(f"e2e_h200_fixed_{size}_8_rows_auto_graphs_{{}}.json", labels)


def labelled_runs(pattern: str, labels: dict[str, str]) -> list[tuple[str, dict]]:
    """(label, e2e.py report) of results/<pattern with each name of `labels`>.json, where it exists."""
    paths = {name: os.path.join(HERE, pattern.format(name)) for name in labels}
    return [(labels[name], json.load(open(path))) for name, path in paths.items() if os.path.exists(path)]


def same_call_pairs(preset: str) -> list[tuple[str, dict, dict]]:
    """(commit, ours, TRL `generate`) measured on one warm machine: one device call at b453d9a (32,768-token
    budget, the QKV bias in its GEMM; e2e_h200_fixed_<size>_qkv_bias_with_trl.json,
    trl_h200_fixed_<size>_same_call_qkv_bias.json), and in one lease at 56a71d6 (the trainer's defaults, the
    one-pass head; e2e_h200_fixed_<size>_56a71d6.json, trl_h200_fixed_<size>_56a71d6.json)."""
    size = preset.removeprefix("qwen2_5_")
    pairs = {
        "b453d9a": (
            f"e2e_h200_fixed_{size}_qkv_bias_with_trl.json",
            f"trl_h200_fixed_{size}_same_call_qkv_bias.json",
        ),
        "56a71d6": (f"e2e_h200_fixed_{size}_56a71d6.json", f"trl_h200_fixed_{size}_56a71d6.json"),
    }
    found = []
    for commit, names in pairs.items():
        ours, trl = (os.path.join(HERE, name) for name in names)
        if os.path.exists(ours) and os.path.exists(trl):
            found.append((commit, json.load(open(ours)), json.load(open(trl))))
    return found


def prompts_once_runs(workload: str) -> list[tuple[str, dict]]:
    """Whole rows and each group's prompt once (trainer.share_prompts, the default since da318f3), the
    trainer's default micro-batches, one call at 90399ed (e2e_h200_<workload>_{whole_rows,share_prompts}_90399ed.json),
    as (label, e2e.py report)."""
    labels = {"whole_rows": "whole rows,\n90399ed", "share_prompts": "prompts once,\n90399ed"}
    return labelled_runs(f"e2e_h200_{workload}_{{}}_90399ed.json", labels)


def one_pass_runs(workload: str) -> list[tuple[str, dict]]:
    """The trainer's defaults at 56a71d6 (the one-pass output head, larger head chunks;
    e2e_h200_<workload>_56a71d6.json), as (label, e2e.py report)."""
    return labelled_runs(f"e2e_h200_{workload}_{{}}.json", {"56a71d6": "one-pass head,\n56a71d6"})


def fixed_panel(ax) -> None:
    """Per preset: ours with the native rollout and with vLLM's (the fastest run of each per GPU), split by
    phase, and TRL's whole step; in GPU-seconds per step (step time x GPUs), so that a 2-GPU run and a 1-GPU
    run compare per GPU."""
    data = json.load(open(os.path.join(HERE, "e2e_h200.json")))
    ours = {backend: fastest(data["runs"], backend) for backend in ("native", "vllm")}
    trl = {r["preset"]: r for r in data["runs"] if r.get("system") == "trl_grpo"}
    presets = [p for p in ("qwen2_5_0_5b", "qwen2_5_1_5b", "qwen2_5_7b") if p in ours["native"] and p in trl]
    ticks, labels, x, legend_done = [], [], 0, set()
    for preset in presets:
        for backend in ("native", "vllm"):
            run = ours[backend].get(preset)
            if run is None:
                continue
            ours_bar(ax, x, run, legend_done)
            ticks.append(x)
            labels.append(f"ours, {backend}\n{preset.removeprefix('qwen2_5_')}\n({run['gpus']} GPU)")
            x += 1
        size = preset.removeprefix("qwen2_5_")
        later = later_fixed_runs(preset) + default_fixed_runs(preset) + prompts_once_runs(f"fixed_{size}")
        for key, run in later:
            ours_bar(ax, x, run, legend_done)
            ticks.append(x)
            labels.append(f"ours, native\n{preset.removeprefix('qwen2_5_')}\n({key})")
            x += 1
        trl_bar(ax, x, trl[preset], legend_done)
        ticks.append(x)
        labels.append(f"TRL\n{preset.removeprefix('qwen2_5_')}\n(1 GPU)")
        x += 1
        for commit, ours_run, trl_run in same_call_pairs(preset):
            ours_bar(ax, x, ours_run, legend_done)
            trl_bar(ax, x + 1, trl_run, legend_done)
            ticks += [x, x + 1]
            labels += [f"ours, native\n{size}\n({commit})", f"TRL\n{size}\n(same machine)"]
            x += 2
        x += 1
    ax.set_xticks(ticks, labels, fontsize=6)
    ax.set_ylabel("GPU-seconds per GRPO step (H200)")
    ax.set_title("fixed: 64 prompts x 8 responses, 256 + 512 tokens, bf16")
    ax.legend(loc="upper left", fontsize=8)


def long_tail_panel(ax) -> None:
    """The long-tailed workload at 0.5B (responses to 1,024 tokens): ours native and vLLM by phase, TRL with
    colocated vLLM and with `generate`."""
    rows = json.load(open(os.path.join(HERE, "e2e_h200_long_tail_1024_0_5b_vllm_rows.json")))
    older = json.load(open(os.path.join(HERE, "e2e_h200_long_tail_1024_0_5b.json")))
    same_day = json.load(open(os.path.join(HERE, "e2e_h200_long_tail_1024_0_5b_verlcall.json")))
    verl = json.load(open(os.path.join(HERE, "verl_h200_long_tail_1024_0_5b.json")))
    bars = [
        ("ours, native", rows["ours_native"], ours_bar),
        ("ours, vllm", rows["ours_vllm"], ours_bar),
        ("TRL, vLLM\n(colocated)", rows["trl_vllm"], trl_bar),
        ("TRL, generate\n(earlier call)", older["trl_generate"], trl_bar),
        ("ours, native\n(verl's day)", {"gpus": 1, **same_day}, ours_bar),
        ("verl 0.9.1\n(padded, no\nflash-attn)", verl, verl_bar),
    ]
    legend_done: set = set()
    later = prompts_once_runs("long_tail_1024_0_5b") + one_pass_runs("long_tail_1024_0_5b")
    bars += [(f"ours, native\n({label})", run, ours_bar) for label, run in later]
    for x, (_, run, draw) in enumerate(bars):
        draw(ax, x, run, legend_done)
    tight_limit(ax, same_day, 0, len(bars) - 1)
    ax.set_xticks(range(len(bars)), [label for label, _, _ in bars], fontsize=7)
    ax.set_title("long tail, qwen2_5_0_5b: 64 x 8, 256 + up to 1,024 (mean 354)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)


def long_tail_4096_panel(ax) -> None:
    """The long-tailed workload at 1.5B (responses to 4,096 tokens): ours native by phase (steady step) before
    and after the Triton draw, at f8be0ad (inverse-CDF draw, flash prefill), at 4e743c9 (the update's RMSNorm
    kernels) and at 613a159, and TRL with colocated vLLM
    (its first step: the second did not finish inside the job's limit)."""
    run = json.load(open(os.path.join(HERE, "e2e_h200_long_tail_4096_1_5b.json")))
    after = json.load(open(os.path.join(HERE, "e2e_h200_long_tail_4096_1_5b_sampler.json")))
    flash = json.load(open(os.path.join(HERE, "e2e_h200_long_tail_4096_1_5b_flash_prefill.json")))
    rmsnorm = json.load(open(os.path.join(HERE, "e2e_h200_long_tail_4096_1_5b_rmsnorm.json")))
    latest = json.load(open(os.path.join(HERE, "e2e_h200_long_tail_4096_1_5b_sourced.json")))
    trl = {"engine": "vllm", "step_s": run["trl_vllm_colocate"]["step_s_all"][0]}
    legend_done: set = set()
    ours_bar(ax, 0, {"gpus": 1, **run}, legend_done)
    ours_bar(ax, 1, after, legend_done)
    ours_bar(ax, 2, flash, legend_done)
    ours_bar(ax, 3, rmsnorm, legend_done)
    ours_bar(ax, 4, latest, legend_done)
    labels = ["ours, native\n(step 2; 9c04e90)", "ours, native\n(step 2; Triton\ndraw, 065f9e3)"]
    labels.append("ours, native\n(step 2; CDF draw,\nflash prefill,\nf8be0ad)")
    labels.append("ours, native\n(step 2; RMSNorm\nkernels, 4e743c9)")
    labels.append("ours, native\n(step 2; 613a159)")
    for label, later in prompts_once_runs("long_tail_4096_1_5b") + one_pass_runs("long_tail_4096_1_5b"):
        ours_bar(ax, len(labels), later, legend_done)
        labels.append(f"ours, native\n(step 2; {label})")
    trl_bar(ax, len(labels), trl, legend_done)
    tight_limit(ax, latest, 0, len(labels))
    ax.set_xticks(range(len(labels) + 1), [*labels, "TRL, vLLM\n(colocated;\nstep 1 only)"], fontsize=7)
    ax.set_title("long tail, qwen2_5_1_5b:\n64 x 8, 256 + up to 4,096 (mean 1,415)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)


def main() -> None:
    fig, (fixed, tail, tail_4096) = plt.subplots(
        1, 3, figsize=(30, 5.6), gridspec_kw={"width_ratios": [3.2, 1.7, 2.0]}
    )
    fixed_panel(fixed)
    long_tail_panel(tail)
    long_tail_4096_panel(tail_4096)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "e2e_h200.png"), dpi=110)


if __name__ == "__main__":
    main()
