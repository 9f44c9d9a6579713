"""One GRPO step, end to end, ours versus TRL's GRPOTrainer on the same GPU, model, batch and lengths.

Ours: `python -m engine.train` under torchrun on copy-task prompts of exactly `--prompt-len` tokens (a parquet
file this script writes, with the embedded character-level tokenizer), random-init weights of a conf/model
preset, EOS ignored, beta 0 (no reference), one PPO iteration. Response lengths: `--lengths fixed` (every
response `--response-len` tokens) or `long_tail` (prompt i's responses stop at
`workload.response_lengths(long_tail, --prompts, --response-len, --seed)[i]` tokens, the draw rollout.py and
trl_grpo.py make with the same arguments; written into the dataset's `max_new_tokens` column, which the
engine passes to either rollout backend as per-prompt limits). The dataset holds exactly `--prompts` rows and
a step takes all of them, so every step has the same lengths. With `--fresh-lengths` (ours only) step s has
its own prompts and draw (seed + s; `--steps` x `--prompts` rows, taken in order: data.shuffle=false), as a
run's steps do, so costs paid once per new shape (plan builds, compiles) land in the timed steps; the step's
figures (tokens, tight limit, MFU) are then each step's own, medians reported. Steps after the first are
timed (median).

Prints one JSON object: per-phase seconds, tokens/s/GPU (real prompt + response tokens / step time / GPUs),
the update's padding fraction, MFU of the actor update (6 x parameters x real tokens; `perf/mfu/actor`, the
trainer's PaLM-style count over real tokens, as `mfu_update_actor_trainer`), peak memory, the share of the
step spent on weight sync and vLLM's sleep/wake (`sync_share`), the issue's tight limit of the step (roofline.py:
generation at the decode roofline + update at 70% MFU; `bound_s`, `step_over_bound`, with its two parts; the
rollout phase's `generation_roofline_fraction`; on a card roofline.py knows that is not an H200, the same
at its own bandwidth: `bound_this_gpu_s`, `step_over_bound_this_gpu`), the looser limit of the earlier
tables (generation at the vLLM anchor's speed + update at 50% MFU; `anchor_bound_s`,
`step_over_anchor_bound`) and the TRL baseline with `--baseline trl` (transformers generate) or `trl_vllm`
(TRL's colocated vLLM) (needs trl; one GPU). With `--gpu-busy`, one step more runs under torch.profiler
(`trainer.profile_steps`), not timed: `gpu_busy` holds the share of each phase's wall time in which the GPU had
work (`gen`: the rollout's), and the trace lands in the run's profile/ directory.

    python scripts/bench/e2e.py --preset qwen2_5_0_5b --gpus 1 --baseline trl
    python scripts/bench/e2e.py --preset qwen2_5_0_5b --lengths long_tail --response-len 4096 --backend vllm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from presets import num_params  # noqa: E402
from roofline import HBM_BYTES_PER_S, dense, report_rates, step_bound  # noqa: E402
from workload import add_step_args, describe, response_lengths  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100/H200 dense bf16 spec (large GEMMs reach ~790e12 in practice)
# vLLM 0.26 LLM.generate alone on one H200, generated tokens/s for these RL-shaped batches
# (the team's performance anchors, restated in scripts/bench/README.md): the generation speed of the anchor bound
VLLM_ANCHOR_TOKENS_PER_S = {"qwen2_5_0_5b": 42_903, "qwen2_5_1_5b": 41_245, "qwen2_5_7b": 21_700}
ANCHOR_BOUND_MFU = 0.5
PROMPT_OVERHEAD = 11  # "<bos>u:copy " + "\na:" around the digits in the embedded chat template


def step_lengths(args) -> list[list[int]]:
    """Each step's response length per prompt: one draw for all steps, or with --fresh-lengths one per step."""
    draws = args.steps if args.fresh_lengths else 1
    per_step = [
        response_lengths(args.lengths, args.prompts, args.response_len, args.seed + s) for s in range(draws)
    ]
    return per_step * (args.steps // draws)


def write_workload(out_dir: str, num_prompts: int, prompt_len: int, caps: list[int] | None, seed: int):
    """The embedded tokenizer and a parquet of `num_prompts` copy prompts of exactly `prompt_len` tokens,
    row i with `max_new_tokens` caps[i] (None: no column values, rollout.max_new_tokens for all).
    Returns (tokenizer dir, parquet path)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from engine.tasks.embedded import build_embedded_tokenizer, embedded_prompt

    tok = build_embedded_tokenizer(os.path.join(out_dir, "tokenizer"))
    rng = random.Random(seed)
    rows = []
    for i in range(num_prompts):
        digits = "".join(rng.choice("0123456789") for _ in range(prompt_len - PROMPT_OVERHEAD))
        rows.append(
            {
                "prompt": [{"role": "user", "content": embedded_prompt("copy", digits)}],
                "data_source": "embedded/copy",
                "reward_model": {"ground_truth": digits, "style": "rule"},
                "extra_info": {"index": i},
                "max_new_tokens": None if caps is None else caps[i],
            }
        )
    path = os.path.join(out_dir, "workload.parquet")
    schema = pa.Table.from_pylist(rows[:1]).schema.set(4, pa.field("max_new_tokens", pa.int64()))
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return tok, path


def gpu_name() -> str:
    """The first GPU's name by nvidia-smi ("" without one): this process leaves CUDA to the trainer's."""
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"]
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_ours(args, out_dir: str) -> dict:
    per_step = step_lengths(args)
    rows_written = per_step if args.fresh_lengths else per_step[:1]
    caps = None if args.lengths == "fixed" else [c for step in rows_written for c in step]
    tok, data = write_workload(out_dir, args.prompts * len(rows_written), args.prompt_len, caps, args.seed)
    overrides = [
        f"model={args.preset}",
        f"cluster={args.cluster}",
        "algorithm=grpo",
        "algorithm.kl_loss_coef=0",
        f"data.train_files=[{data}]",
        f"model.tokenizer_path={tok}",
        f"data.max_prompt_len={args.prompt_len + 8}",
        f"data.batch_size={args.prompts}",
        f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.response_len}",
        "rollout.ignore_eos=true",
        f"rollout.backend={args.backend}",
        f"rollout.tp={args.rollout_tp}",
        f"parallel.tp={args.tp}",
        f"parallel.pp={args.pp}",
        *([] if args.micro_batch is None else [f"trainer.micro_batch_size={args.micro_batch}"]),
        f"trainer.max_tokens_per_micro_batch={args.max_tokens}",
        f"rollout.max_num_seqs={args.max_num_seqs}",
        f"trainer.total_steps={args.steps + args.gpu_busy}",
        *([f"trainer.profile_steps=[{args.steps + 1}]"] if args.gpu_busy else []),
        "trainer.test_freq=0",
        "trainer.loggers=[jsonl]",
        "trainer.progress_bar=false",
        f"trainer.output_dir={out_dir}",
        *(["data.shuffle=false"] if args.fresh_lengths else []),
        *args.extra,
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.gpus}",
        "-m",
        "engine.train",
        *overrides,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"system": "ours", "error": (proc.stdout + proc.stderr)[-4000:]}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows, profiled = rows[: args.steps], rows[args.steps :]  # --gpu-busy: the profiled step, not timed
    steady = list(zip(rows, per_step))[1:] or list(zip(rows, per_step))
    med = {
        k: statistics.median(r[k] for r, _ in steady)
        for k in steady[0][0]
        if isinstance(steady[0][0][k], (int, float))
    }
    engine = {k.removeprefix("rollout_engine/"): v for k, v in med.items() if k.startswith("rollout_engine/")}
    rows_trained = args.prompts * args.n

    def step_tokens(lengths: list[int]) -> int:  # real tokens: no padding, EOS ignored
        return rows_trained * args.prompt_len + args.n * sum(lengths)

    tokens = statistics.median(step_tokens(lengths) for _, lengths in steady)
    response_tokens = tokens - rows_trained * args.prompt_len
    params = num_params(args.preset)
    update_flops = 6 * params * tokens
    # the tight limit (roofline.py), and the looser one of the earlier tables: generation at the vLLM
    # anchor's speed + the update at 50% MFU (on-policy GRPO without a reference needs no extra forward pass)
    tight = {"seconds": None, "generation_s": None, "update_s": None}  # MoE: no roofline (roofline.dense)
    over_bound, this_gpu = None, {}
    if dense(args.preset):
        shape = (args.preset, args.prompts, args.n, args.prompt_len)

        def limits(rate: float) -> list[tuple[dict, dict]]:  # (step row, its tight limit at `rate` bytes/s)
            return [
                (r, step_bound(*shape, lengths, args.gpus, args.rollout_tp, rate)) for r, lengths in steady
            ]

        bounds = limits(HBM_BYTES_PER_S)
        tight = {
            k: statistics.median(b[k] for _, b in bounds) for k in ("seconds", "generation_s", "update_s")
        }
        over_bound = statistics.median(r["timing/step"] / b["seconds"] for r, b in bounds)
        card = report_rates(gpu_name()).get("_this_gpu")
        if card is not None:  # the same limit at this card's memory bandwidth
            at_card = limits(card)
            this_gpu = {
                "bound_this_gpu_s": statistics.median(b["seconds"] for _, b in at_card),
                "step_over_bound_this_gpu": statistics.median(
                    r["timing/step"] / b["seconds"] for r, b in at_card
                ),
            }
    mfu_update = statistics.median(  # with trainer.share_prompts the tokens computed: prompts once
        6
        * params
        * step_tokens(lengths)
        * (1.0 - r.get("perf/shared_prompt_fraction", 0.0))
        / r["timing/update_actor"]
        / (PEAK_BF16_FLOPS * args.gpus)
        for r, lengths in steady
    )
    gen_rate = args.vllm_tokens_per_s or VLLM_ANCHOR_TOKENS_PER_S.get(args.preset)
    anchor = None
    if gen_rate:
        anchor = response_tokens / (gen_rate * args.gpus)
        anchor += update_flops / (ANCHOR_BOUND_MFU * PEAK_BF16_FLOPS * args.gpus)
    return {
        "system": "ours",
        "backend": args.backend,
        "bound_s": tight["seconds"],
        "bound_generation_s": tight["generation_s"],
        # the rollout's share of the decode roofline (rollout.py's roofline_fraction, inside a training step)
        "generation_roofline_fraction": (
            tight["generation_s"] / med["timing/gen"]
            if tight["generation_s"] and med.get("timing/gen")
            else None
        ),
        "bound_update_s": tight["update_s"],
        "step_over_bound": over_bound,
        **this_gpu,
        "anchor_bound_s": anchor,
        "step_over_anchor_bound": med["timing/step"] / anchor if anchor else None,
        "step_s": med["timing/step"],
        "step_s_all": [r["timing/step"] for r in rows],
        "fresh_lengths": args.fresh_lengths,
        "tokens_all": [step_tokens(lengths) for lengths in per_step],
        "tokens_per_s_per_gpu": med["perf/tokens_per_s_per_gpu"],
        "tokens": tokens,
        "tokens_trained": med.get("perf/total_tokens"),  # what the trainer counted: equals tokens
        "response_length_mean": med.get("response_length/mean"),
        "timing": {k.removeprefix("timing/"): v for k, v in med.items() if k.startswith("timing/")},
        "mfu_update_actor": mfu_update,
        "mfu_update_actor_trainer": med.get("perf/mfu/actor"),
        "peak_memory_gb": med.get("perf/max_memory_allocated_gb"),
        "padding_fraction": med.get("perf/padding_fraction"),  # of the update's forwards
        "shared_prompt_fraction": med.get("perf/shared_prompt_fraction"),  # trainer.share_prompts
        "shared_split_fraction": med.get("perf/shared_split_fraction"),  # shared_prompt_split.py
        "shared_cudnn_fraction": med.get("perf/shared_cudnn_fraction"),
        "tokens_per_micro_batch": med.get("perf/tokens_per_micro_batch"),
        "cuda_graph_replayed_fraction": med.get("perf/cuda_graph_replayed_fraction"),  # trainer.cuda_graphs
        "rollout_engine": engine,
        # --gpu-busy: the share of each phase's wall time with work on the GPU (engine/step_profiler.py), of
        # one more step under the profiler (at --fresh-lengths it takes the first step's prompts again)
        "gpu_busy": {
            k.removeprefix("perf/gpu_busy/"): v
            for k, v in profiled[0].items()
            if k.startswith("perf/gpu_busy/")
        }
        if profiled
        else None,
        "profile_dir": os.path.join(out_dir, "profile") if profiled else None,
        # the "weight sync plus sleep/wake" share: train -> rollout layout and back, and vLLM's wake-up +
        # weight copy + sleep (inside timing/gen); the native engine reads the regrouped weights in place
        "sync_share": (
            med.get("timing/reshard", 0.0) + engine.get("wake_load_s", 0.0) + engine.get("sleep_s", 0.0)
        )
        / med["timing/step"],
    }


def run_trl(args) -> dict:
    cmd = [
        sys.executable,
        os.path.join(os.path.dirname(__file__), "trl_grpo.py"),
        "--preset",
        args.preset,
        "--prompts",
        str(args.prompts),
        "--n",
        str(args.n),
        "--prompt-len",
        str(args.prompt_len),
        "--response-len",
        str(args.response_len),
        "--steps",
        str(args.steps),
        "--lengths",
        args.lengths,
        "--seed",
        str(args.seed),
        *(["--vllm"] if args.baseline == "trl_vllm" else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"system": "trl_grpo", "error": (proc.stdout + proc.stderr)[-4000:]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_0_5b")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--cluster", default="single_gpu")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--rollout-tp", type=int, default=1)
    ap.add_argument("--backend", default="native")
    add_step_args(ap)
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="trainer.micro_batch_size (default: left empty, the trainer's: engine/micro_batch_sizing.py)",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="trainer.max_tokens_per_micro_batch (0 = off, the trainer's default; until 2026-12-04 32768 here)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=512, help="rollout.max_num_seqs")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--fresh-lengths", action="store_true", help="long_tail: each step its own prompts and length draw"
    )
    ap.add_argument(
        "--gpu-busy",
        action="store_true",
        help="one step more, under torch.profiler (trainer.profile_steps), untimed: the GPU's busy share per phase",
    )
    ap.add_argument(
        "--vllm-tokens-per-s",
        type=float,
        default=0.0,
        help="generation speed of the anchor bound, per GPU (default: the vLLM anchor of the preset)",
    )
    ap.add_argument(
        "--baseline",
        default="none",
        choices=["none", "trl", "trl_vllm"],
        help="also run TRL's GRPOTrainer: transformers generate (trl) or colocated vLLM (trl_vllm)",
    )
    ap.add_argument("extra", nargs="*", help="more key=value overrides for engine.train")
    args = ap.parse_args()
    result = {
        "preset": args.preset,
        "gpus": args.gpus,
        "prompts": args.prompts,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "micro_batch": args.micro_batch,  # None: the trainer's default (engine/micro_batch_sizing.py)
        "max_tokens": args.max_tokens,
        "overrides": args.extra,
        "lengths": {
            "kind": args.lengths,
            "seed": args.seed,
            **describe(
                response_lengths(args.lengths, args.prompts, args.response_len, args.seed), args.response_len
            ),
        },
    }
    result["ours"] = run_ours(args, tempfile.mkdtemp(prefix="e2e-"))
    if args.baseline != "none":
        result["baseline"] = run_trl(args)
        if "error" not in result["baseline"] and "error" not in result["ours"]:
            result["speedup"] = (
                result["ours"]["tokens_per_s_per_gpu"] / result["baseline"]["tokens_per_s_per_gpu"]
            )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
