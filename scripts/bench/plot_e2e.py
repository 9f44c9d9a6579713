"""Per-phase time of one GRPO step, ours (native and vLLM rollout) versus TRL's GRPOTrainer, from scripts/bench/results/e2e_h200.json.

pip install matplotlib && python scripts/bench/plot_e2e.py   # writes scripts/bench/results/e2e_h200.png
"""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.join(os.path.dirname(__file__), "results")
PHASES = (("gen", "rollout (gen)"), ("update_actor", "actor update"), ("other", "reward, adv, reshard"))


def fastest(runs: list[dict], backend: str) -> dict[str, dict]:
    """Per preset, the run of `backend` with the fewest GPU-seconds per step."""
    best: dict[str, dict] = {}
    for r in runs:
        if "ours" in r and r["ours"].get("backend") == backend and "step_s" in r["ours"]:
            cur = best.get(r["preset"])
            if cur is None or r["ours"]["step_s"] * r["gpus"] < cur["ours"]["step_s"] * cur["gpus"]:
                best[r["preset"]] = r
    return best


def main() -> None:
    """Per preset: ours with the native rollout and with vLLM's (the fastest run of each per GPU), split by
    phase, and TRL's whole step; in GPU-seconds per step (step time x GPUs), so that a 2-GPU run and a 1-GPU
    run compare per GPU."""
    data = json.load(open(os.path.join(HERE, "e2e_h200.json")))
    ours = {backend: fastest(data["runs"], backend) for backend in ("native", "vllm")}
    trl = {r["preset"]: r for r in data["runs"] if r.get("system") == "trl_grpo"}
    presets = [p for p in ("qwen2_5_0_5b", "qwen2_5_1_5b", "qwen2_5_7b") if p in ours["native"] and p in trl]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    ticks, labels, x = [], [], 0
    colors = {"gen": "#4c72b0", "update_actor": "#dd8452", "other": "#8c8c8c"}
    legend_done = set()
    for preset in presets:
        for backend in ("native", "vllm"):
            run = ours[backend].get(preset)
            if run is None:
                continue
            t, gpus = run["ours"]["timing"], run["gpus"]
            parts = {"gen": t["gen"], "update_actor": t["update_actor"]}
            parts["other"] = t["step"] - parts["gen"] - parts["update_actor"]
            bottom = 0.0
            for key, name in PHASES:
                label = None if key in legend_done else name
                legend_done.add(key)
                ax.bar(x, parts[key] * gpus, bottom=bottom, color=colors[key], label=label)
                bottom += parts[key] * gpus
            ax.text(x, bottom + 0.5, f"{bottom:.1f}", ha="center", fontsize=8)
            ticks.append(x)
            labels.append(f"ours, {backend}\n{preset}\n({gpus} GPU)")
            x += 1
        ax.bar(
            x,
            trl[preset]["step_s"],
            color="#55a868",
            label=None if "trl" in legend_done else "TRL (whole step)",
        )
        legend_done.add("trl")
        ax.text(x, trl[preset]["step_s"] + 0.5, f"{trl[preset]['step_s']:.1f}", ha="center", fontsize=8)
        ticks.append(x)
        labels.append(f"TRL\n{preset}\n(1 GPU)")
        x += 2
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel("GPU-seconds per GRPO step (H200)")
    ax.set_title("64 prompts x 8 responses, 256 + 512 tokens, bf16")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "e2e_h200.png"), dpi=110)


if __name__ == "__main__":
    main()
