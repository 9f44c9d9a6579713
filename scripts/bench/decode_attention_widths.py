"""The Triton decode attention at a long-tailed rollout's (width, context) pairs, inside CUDA graphs as the
native engine runs it, against an earlier version of the kernel and vLLM's FlashAttention-3; prints JSON.

    git show ec9f686:engine/rollout/triton_decode.py > scripts/bench/.before_triton_decode.py
    bash scripts/bench/run.sh attention_widths -- --before scripts/bench/.before_triton_decode.py   # GPU

Each case is one layer's decode attention for `rows` rows of a cache sized for the workload's longest row
(`--capacity`, as the engine sizes it), row r at cur_r = ctx - 1 - U[0, 200) over [pad_r, cur_r] (pads in
[0, 32)). Reported: median microseconds per call (20 calls captured in one CUDA graph, 15 replays), the K/V
bytes read, TB/s, the split count, and the largest difference between `--before` and the current kernel;
`--sweep-splits`: the time at each split count of SPLIT_COUNTS and the fastest (`best_splits`), against the
count `num_splits` picks (4 waves of programs on the GPU's SMs, 2 where rows x groups alone fill them).
`vllm_fa3_us` (when vLLM imports): `flash_attn_varlen_func(fa_version=3)` over the same cache viewed as
16-position pages, eager (its launch does not capture without vLLM's scheduler metadata), reading [0, cur_r].
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_timing import event_ms, graph_ms  # noqa: E402
from presets import hf_config_for  # noqa: E402

from engine.rollout import triton_decode  # noqa: E402

# the 1.5B long tail to 16,384 (README "Rollout"): the widths the engine decodes at and their contexts
CASES = "256:400,128:1400,96:3600,64:5000,48:6500,32:8000,24:9000,16:10000,8:12000,6:14000,8:2000"
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def graph_us(fn) -> float:
    return 1e3 * graph_ms(fn)


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("triton_decode_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fa3_call(q, k, v, cur):
    """vLLM's FA3 on the cache as a page table of 16 positions, or None where vLLM is not installed."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    rows, cap, groups, dim = k.shape
    pages = cap // 16
    kc, vc = k.view(rows * pages, 16, groups, dim), v.view(rows * pages, 16, groups, dim)
    table = (
        torch.arange(rows, device=k.device)[:, None] * pages + torch.arange(pages, device=k.device)
    ).int()
    qf = q.reshape(rows, -1, dim)
    cu_q = torch.arange(rows + 1, device=k.device, dtype=torch.int32)
    used, longest = (cur + 1).int(), int(cur.max()) + 1
    return lambda: flash_attn_varlen_func(
        qf, kc, vc, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=longest, seqused_k=used,
        block_table=table, causal=True, fa_version=3,
    )  # fmt: skip


def measure(rows: int, ctx: int, capacity: int, cfg: dict, before, gen: torch.Generator, sweep: bool) -> dict:
    groups, dim = cfg["num_key_value_heads"], cfg["head_dim"]
    per_group = cfg["num_attention_heads"] // groups
    dev, dt = gen.device, torch.bfloat16
    k, v = (torch.randn(rows, capacity, groups, dim, device=dev, dtype=dt, generator=gen) for _ in "kv")
    q = torch.randn(rows, groups, per_group, dim, device=dev, dtype=dt, generator=gen)
    pad = torch.randint(0, 32, (rows,), device=dev, generator=gen)
    cur = ctx - 1 - torch.randint(0, 200, (rows,), device=dev, generator=gen)
    gb = float(2 * (cur + 1 - pad).sum() * groups * dim * k.element_size()) / 1e9
    r = {"rows": rows, "ctx": ctx, "kv_gb": round(gb, 4)}
    r["splits"] = triton_decode.num_splits(rows * groups, capacity, 64, dev)
    r["after_us"] = graph_us(lambda: triton_decode.decode_attention(q, k, v, pad, cur))
    if before is not None:
        r["before_us"] = graph_us(lambda: before.decode_attention(q, k, v, pad, cur))
        diff = before.decode_attention(q, k, v, pad, cur).float() - triton_decode.decode_attention(
            q, k, v, pad, cur
        )
        r["max_abs_diff"] = float(diff.abs().max())
    if sweep:  # the split count the heuristic would not pick: which one each (width, context) wants
        counts = sorted({c for c in SPLIT_COUNTS if c <= triton_decode.MAX_SPLITS} | {r["splits"]})
        r["splits_us"] = {
            c: round(graph_us(lambda c=c: triton_decode.decode_attention(q, k, v, pad, cur, splits=c)), 2)
            for c in counts
        }
        r["best_splits"] = min(r["splits_us"], key=r["splits_us"].get)
    fa3 = fa3_call(q, k, v, cur)
    if fa3 is not None:
        r["vllm_fa3_us"] = 1e3 * statistics.median(event_ms(fa3) for _ in range(30))
    for key in ("after", "before", "vllm_fa3"):
        if key + "_us" in r:
            r[key + "_tb_per_s"] = round(gb / r[key + "_us"] * 1e3, 3)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_1_5b")
    ap.add_argument("--capacity", type=int, default=16640, help="cache positions per row (16,384 + 256)")
    ap.add_argument("--cases", default=CASES, help="rows:context pairs")
    ap.add_argument("--before", help="an earlier engine/rollout/triton_decode.py to time next to this one")
    ap.add_argument("--sweep-splits", action="store_true", help="also time every split count of SPLIT_COUNTS")
    args = ap.parse_args()
    cfg = hf_config_for(args.preset)
    before = load_module(args.before) if args.before else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    pairs = [tuple(int(x) for x in case.split(":")) for case in args.cases.split(",")]
    cases = [measure(rows, ctx, args.capacity, cfg, before, gen, args.sweep_splits) for rows, ctx in pairs]
    print(json.dumps({"preset": args.preset, "capacity": args.capacity, "device": torch.cuda.get_device_name(),
                      "cases": cases}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
