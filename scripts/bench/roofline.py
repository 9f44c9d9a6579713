"""The issue's tight limits of a GRPO step on an H200, computed from a workload's lengths and a preset's shapes.

The issue states its limit for an H200 (`HBM_BYTES_PER_S`); `--gpu` (and the functions' `hbm_bytes_per_s`)
computes the same limit at another card's bandwidth (`HBM_BYTES_PER_S_BY_GPU`), so that a run on an H100 is
held against its own memory, not the H200's.

- Generation at the decode roofline: the prefill of every prompt at `GEMM_FLOPS`, then one decode step per
  generated position, each taking max(bytes / `HBM_BYTES_PER_S`, FLOPs / `GEMM_FLOPS`). A step's bytes are
  the weights its matmuls read (every linear layer and the output head; the input embedding is a lookup) and
  the K/V of every live row's context; its FLOPs are 2 x matmul parameters per live row plus the attention's
  4 x layers x heads x head_dim per (query, key) pair. Rows finished at their length leave the step; a
  replica (one rollout engine per `rollout_tp` GPUs) takes its share of the rows, balanced by length.
- The actor update at `UPDATE_MFU` of the bf16 peak: 6 x parameters x real tokens (the count e2e.py's
  `mfu_update_actor` uses).

These are lower bounds of an ideal engine, not models of ours: no kernel launch, no sampler, no waste.

    python scripts/bench/roofline.py --preset qwen2_5_1_5b --lengths long_tail --response-len 4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from presets import model_preset, num_params  # noqa: E402
from workload import add_step_args, response_lengths  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e: the card
HBM_BYTES_PER_S_BY_GPU = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12}
"""HBM bandwidth by a part of torch.cuda.get_device_name (NVIDIA's datasheets: H200 SXM HBM3e, H100 SXM5 HBM3);
both reach the same bf16 GEMM rate, so `GEMM_FLOPS` holds for each."""
GEMM_FLOPS = 790e12  # dense bf16 that large GEMMs reach on an H100/H200
PEAK_BF16_FLOPS = 989e12  # the spec; MFU is counted against it
UPDATE_MFU = 0.7
DTYPE_BYTES = 2  # bf16 weights and K/V


def dense(preset: str) -> bool:
    """Whether the roofline applies: MoE layers read and compute only their chosen experts (not counted)."""
    return not model_preset(preset).get("moe")


@dataclass(frozen=True)
class DecodeShapes:
    """What one decode step reads and computes, per row and per context position."""

    weight_bytes: float  # the matmuls' weights (all linear layers and the head)
    matmul_params: int  # 2 FLOPs per parameter per row
    kv_bytes_per_position: int  # K and V of every layer
    attention_flops_per_key: int  # per (query, key) pair, all layers

    @classmethod
    def of(cls, preset: str) -> DecodeShapes:
        m = model_preset(preset)
        h, layers, vocab = m["hidden_size"], m["num_layers"], m.get("vocab_size", 50)
        heads, groups = m["num_attention_heads"], m["num_query_groups"]
        head_dim = m.get("head_dim") or h // heads
        if not dense(preset):
            raise ValueError(
                f"preset {preset!r}: the roofline counts dense models only (MoE reads top-k experts)"
            )
        lookup = vocab * h if not m.get("tie_embeddings") else 0  # untied: the input table is only indexed
        matmul = num_params(preset) - lookup - h * (2 * layers + 1)  # less the norms' weights
        return cls(
            weight_bytes=matmul * DTYPE_BYTES,
            matmul_params=matmul,
            kv_bytes_per_position=layers * 2 * groups * head_dim * DTYPE_BYTES,
            attention_flops_per_key=4 * layers * heads * head_dim,
        )


def gpu_hbm_bytes_per_s(device_name: str) -> float | None:
    """The HBM bandwidth of the card named `device_name` (torch.cuda.get_device_name); None where the table
    does not know it."""
    for part, rate in HBM_BYTES_PER_S_BY_GPU.items():
        if part in device_name:
            return rate
    return None


def report_rates(device_name: str) -> dict[str, float]:
    """The bandwidths to hold a run on `device_name` against, by the suffix of its report keys: "" the issue's
    (the H200's), and "_this_gpu" the card's own where the table knows it and it differs."""
    rates = {"": HBM_BYTES_PER_S}
    rate = gpu_hbm_bytes_per_s(device_name)
    if rate is not None and rate != HBM_BYTES_PER_S:
        rates["_this_gpu"] = rate
    return rates


def _decode_steps(
    shapes: DecodeShapes, prompt_len: int, lengths: np.ndarray, hbm_bytes_per_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """(live rows, seconds) of each decode step of one GPU generating `lengths` after prompts of
    `prompt_len`: the prefill produced each row's first token; step t (1 <= t < max) makes token t + 1 of
    every row longer than t, attending over prompt_len + t keys."""
    steps = np.arange(1, int(lengths.max()) if len(lengths) else 1)
    live = (lengths[None, :] > steps[:, None]).sum(axis=1).astype(np.float64)
    keys = live * (prompt_len + steps)
    step_bytes = shapes.weight_bytes + keys * shapes.kv_bytes_per_position
    step_flops = 2.0 * shapes.matmul_params * live + keys * shapes.attention_flops_per_key
    return live, np.maximum(step_bytes / hbm_bytes_per_s, step_flops / GEMM_FLOPS)


def _replica_seconds(
    shapes: DecodeShapes, prompt_len: int, lengths: np.ndarray, tp: int, hbm_bytes_per_s: float
) -> dict:
    """Prefill and decode seconds of one replica generating `lengths` after prompts of `prompt_len`."""
    rows = len(lengths)
    if rows == 0:
        return {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
    # prefill: every prompt position through the matmuls, causal attention, the head's last position only
    # (counted with the matmuls: an upper bound by one head per prompt position is not what an engine does)
    prefill_flops = rows * (
        2 * shapes.matmul_params * prompt_len
        + shapes.attention_flops_per_key * prompt_len * (prompt_len + 1) / 2
    )
    prefill_s = max(prefill_flops / GEMM_FLOPS, shapes.weight_bytes / hbm_bytes_per_s) / tp
    live, decode = _decode_steps(shapes, prompt_len, lengths, hbm_bytes_per_s)
    return {"prefill_s": float(prefill_s), "decode_s": float(decode.sum() / tp), "decode_steps": len(live)}


def decode_roofline_by_width(
    preset: str,
    prompt_len: int,
    row_lengths: list[int],
    widths: list[int],
    hbm_bytes_per_s: float = HBM_BYTES_PER_S,
) -> dict[int, tuple[int, float]]:
    """The decode steps of the roofline on one GPU, grouped by the batch width an engine runs them at: the
    smallest of `widths` that holds the step's live rows (the widest where none does) -> (steps, seconds).
    Set beside an engine's per-width step times, it says at which widths the distance is."""
    ordered = sorted(widths)
    shapes = DecodeShapes.of(preset)
    live, seconds = _decode_steps(
        shapes, prompt_len, np.asarray(row_lengths, dtype=np.int64), hbm_bytes_per_s
    )
    at = np.minimum(np.searchsorted(ordered, live), len(ordered) - 1)
    return {
        w: (int((at == i).sum()), float(seconds[at == i].sum()))
        for i, w in enumerate(ordered)
        if (at == i).any()
    }


def generation_roofline(
    preset: str,
    prompt_len: int,
    row_lengths: list[int],
    gpus: int = 1,
    rollout_tp: int = 1,
    hbm_bytes_per_s: float = HBM_BYTES_PER_S,
) -> dict:
    """Seconds of the generation at the roofline: rows dealt to `gpus // rollout_tp` replicas in order of
    length (balanced), each replica's weights and FLOPs split over its `rollout_tp` GPUs; the slowest replica
    bounds the phase. Memory at `hbm_bytes_per_s` (default: the H200's)."""
    if gpus % rollout_tp:
        raise ValueError(f"gpus={gpus} is not a multiple of rollout_tp={rollout_tp}")
    shapes = DecodeShapes.of(preset)
    replicas = gpus // rollout_tp
    ordered = np.sort(np.asarray(row_lengths, dtype=np.int64))[::-1]
    per = [
        _replica_seconds(shapes, prompt_len, ordered[r::replicas], rollout_tp, hbm_bytes_per_s)
        for r in range(replicas)
    ]
    slowest = max(per, key=lambda p: p["prefill_s"] + p["decode_s"])
    return {
        "seconds": slowest["prefill_s"] + slowest["decode_s"],
        "prefill_s": slowest["prefill_s"],
        "decode_s": slowest["decode_s"],
        "decode_steps": slowest["decode_steps"],
        "tokens": int(np.sum(row_lengths)),
    }


def add_rooflines(
    report: dict, results: dict, preset: str, prompt_len: int, rows: list[int], gpu: str
) -> None:
    """rollout.py's roofline keys, for each of `report_rates(gpu)` (suffix "" and "_this_gpu"): the report's
    `roofline`, each backend's `roofline_fraction` (roofline seconds / its seconds) and, where its engine
    stats hold steps by width, their `roofline_ms_per_step_by_width` (the roofline's steps at those widths)."""
    for suffix, rate in report_rates(gpu).items():
        roof = generation_roofline(preset, prompt_len, rows, hbm_bytes_per_s=rate)
        rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in roof.items()}
        report["roofline" + suffix] = {**rounded, "hbm_tb_per_s": rate / 1e12}
        for r in results.values():
            if "seconds" in r:
                r["roofline_fraction" + suffix] = round(roof["seconds"] / r["seconds"], 3)
            widths = [int(w) for w in r.get("engine_stats", {}).get("decode_steps_by_width", {})]
            if widths:
                at = decode_roofline_by_width(preset, prompt_len, rows, widths, rate)
                at = {w: round(1e3 * sec / steps, 3) for w, (steps, sec) in at.items()}
                r["engine_stats"]["roofline_ms_per_step_by_width" + suffix] = at


def update_bound_s(preset: str, tokens: int, gpus: int = 1) -> float:
    """Seconds of the actor update over `tokens` real tokens at `UPDATE_MFU`."""
    return 6 * num_params(preset) * tokens / (UPDATE_MFU * PEAK_BF16_FLOPS * gpus)


def step_bound(
    preset: str,
    prompts: int,
    n: int,
    prompt_len: int,
    lengths: list[int],
    gpus: int = 1,
    rollout_tp: int = 1,
    hbm_bytes_per_s: float = HBM_BYTES_PER_S,
) -> dict:
    """The issue's tight limit of one GRPO step (no reference, no critic): generation at the roofline plus the
    update at 70% MFU (and `generation`: the generation roofline's own report). `lengths` holds one response
    length per prompt; its n samples share it. Memory at `hbm_bytes_per_s` (default: the H200's)."""
    rows = [length for length in lengths for _ in range(n)]
    gen = generation_roofline(preset, prompt_len, rows, gpus, rollout_tp, hbm_bytes_per_s)
    tokens = prompts * n * prompt_len + gen["tokens"]
    update = update_bound_s(preset, tokens, gpus)
    return {
        "seconds": gen["seconds"] + update,
        "generation_s": gen["seconds"],
        "update_s": update,
        "generation": gen,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2_5_1_5b")
    add_step_args(ap)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--rollout-tp", type=int, default=1)
    ap.add_argument(
        "--gpu", default="H200", choices=sorted(HBM_BYTES_PER_S_BY_GPU), help="whose memory bandwidth"
    )
    args = ap.parse_args()
    lengths = response_lengths(args.lengths, args.prompts, args.response_len, args.seed)
    rate = HBM_BYTES_PER_S_BY_GPU[args.gpu]
    step = step_bound(
        args.preset, args.prompts, args.n, args.prompt_len, lengths, args.gpus, args.rollout_tp, rate
    )
    print(json.dumps({"generation": step.pop("generation"), "step": step}))


if __name__ == "__main__":
    main()
