"""Host time per call of the update's per-layer operations: what a launch-bound micro-batch spends on the CPU.

Small micro-batches leave the GPU waiting on the host (scripts/bench/README.md, "Update": 8 rows of 768 tokens
at 1.5B take 1.25 s per update for 0.81 s of kernels). This times, one at a time, the host side of the ops
each layer runs: a call is repeated `--iters` times without synchronising, so on a GPU the figure is the CPU's
cost per call as long as the GPU keeps up (the inputs are one micro-batch of `--tokens` tokens, small enough).
A tiny aten op and `torch.empty` are the floor to read the others against.

    python scripts/bench/host_costs.py --preset qwen2_5_1_5b [--tokens 512] [--iters 2000]

Prints one JSON object: `us_per_call` by op (microseconds of host time), with the shapes used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from presets import model_preset  # noqa: E402

from engine.models.spec import LastPackedPositions, RMSNorm, fused_rope_thd, packed_positions  # noqa: E402


def host_us(fn, iters: int, device: torch.device) -> float:
    """Host microseconds per call of `fn` over `iters` calls after one warm-up, without a sync in between."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return round(elapsed / iters * 1e6, 2)


def measure(preset: str, tokens: int, rows: int, iters: int, device: torch.device) -> dict:
    m = model_preset(preset)
    hidden, heads = m["hidden_size"], m["num_attention_heads"]
    head_dim = m.get("head_dim") or hidden // heads
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    norm = RMSNorm(SimpleNamespace(params_dtype=dtype, sequence_parallel=False), hidden).to(device)
    weight = norm.weight.detach()
    dy = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    linear = torch.randn(hidden, hidden, generator=g).to(device, dtype)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(device, dtype)
    freqs = torch.randn(tokens, 1, 1, head_dim, generator=g).to(device)
    bounds = torch.linspace(0, tokens, rows + 1).round().to(torch.int32)
    cu = bounds.to(device)
    cache = LastPackedPositions()
    xg = x.clone().requires_grad_()

    ops = {
        "tiny_add_": lambda: x[:1, :1].add_(0),
        "empty": lambda: torch.empty(16, device=device),
        "matmul": lambda: x @ linear,
        "F.rms_norm x weight": lambda: weight * F.rms_norm(x, (hidden,), eps=1e-6),
        "engine rms_norm forward": lambda: norm(x),
        "engine rms_norm forward+backward": lambda: norm(xg).backward(dy),
        "mul forward+backward (floor of the above)": lambda: (xg * norm.weight).backward(dy),
        "packed_positions": lambda: packed_positions(cu, tokens),
        "packed_positions, cached (a layer after the first)": lambda: cache(cu, tokens),
        "fused_rope_thd (RoPE of packed q)": lambda: fused_rope_thd(q, cu, freqs),
    }
    return {name: host_us(fn, iters, device) for name, fn in ops.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2_5_1_5b", help="conf/model preset: hidden size and heads")
    ap.add_argument("--tokens", type=int, default=512, help="tokens of the micro-batch")
    ap.add_argument("--rows", type=int, default=2, help="packed rows the tokens are split into")
    ap.add_argument("--iters", type=int, default=2000, help="calls timed per op")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "tokens": args.tokens,
        "rows": args.rows,
        "iters": args.iters,
        "us_per_call": measure(args.preset, args.tokens, args.rows, args.iters, device),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
