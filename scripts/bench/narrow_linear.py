"""A decode step's linear layers at narrow batch widths: cuBLAS (`F.linear`) against the Triton kernel of
engine/rollout/triton_linear.py, per preset matrix (QKV with its bias, attention output, fused gate/up, down,
the output head) and width; prints one JSON object.

Each variant runs `--reps` times per CUDA graph replay (the engine replays its decode steps as graphs) over
enough copies of the weight to exceed the 50 MB L2 between reuses, as a decode step reads each weight once.
Reported: microseconds per matmul (median of --iters replays), the weight's GB/s, the Triton kernel at its
default heuristic and, with `--sweep`, at its best configuration with that configuration.

    python scripts/bench/narrow_linear.py --presets qwen2_5_1_5b,qwen2_5_7b --sweep      # GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from presets import model_preset  # noqa: E402

from engine.rollout import triton_linear  # noqa: E402

L2_BYTES = 50 * 2**20


def matrices(preset: str) -> dict[str, tuple[int, int, bool]]:
    """name -> (out, in, bias) of one layer's matmuls and the head."""
    m = model_preset(preset)
    h, f = m["hidden_size"], m["ffn_hidden_size"]
    hd = m.get("head_dim") or h // m["num_attention_heads"]
    q, kv = m["num_attention_heads"] * hd, m["num_query_groups"] * hd
    return {
        "qkv": (q + 2 * kv, h, bool(m.get("qkv_bias"))),
        "proj": (h, q, False),
        "fc1": (2 * f, h, False),
        "fc2": (h, f, False),
        "head": (m["vocab_size"], h, False),
    }


def graph_us(fn, reps: int, iters: int) -> float:
    """Microseconds per call of `fn(i)` for i in range(reps), captured as one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(reps):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    times = []
    for _ in range(iters + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times[2:])


SWEEP = [
    triton_linear.Config(block_n=bn, block_k=bk, splits=s, num_stages=st)
    for bn, bk, s, st in itertools.product((64, 128), (128, 256), (0, 1, 4), (3, 4))
]


def measure(n: int, k: int, has_bias: bool, width: int, args) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    copies = max(1, -(-2 * L2_BYTES // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(copies)]
    b = torch.randn(n, device=dev, dtype=dt) if has_bias else None
    x = torch.randn(width, k, device=dev, dtype=dt)
    ref = F.linear(x, ws[0], b).float()
    err = float((triton_linear.linear(x, ws[0], b).float() - ref).abs().max())
    cublas = graph_us(lambda i: F.linear(x, ws[i % copies], b), args.reps, args.iters)
    triton = graph_us(lambda i: triton_linear.linear(x, ws[i % copies], b), args.reps, args.iters)
    row = {
        "cublas_us": round(cublas, 2),
        "triton_us": round(triton, 2),
        "speedup": round(cublas / triton, 3),
        "cublas_tb_per_s": round(n * k * 2 / cublas / 1e6, 2),
        "triton_tb_per_s": round(n * k * 2 / triton / 1e6, 2),
        "max_abs_diff": round(err, 4),
    }
    if args.sweep and str(width) in args.sweep_widths.split(","):
        timed = []
        for cfg in SWEEP:
            try:
                us = graph_us(lambda i, c=cfg: triton_linear.linear(x, ws[i % copies], b, c), args.reps, 5)
            except Exception:  # a configuration past the GPU's shared memory
                continue
            timed.append((us, cfg))
        us, cfg = min(timed, key=lambda t: t[0])
        row.update(best_us=round(us, 2), best_speedup=round(cublas / us, 3), best=cfg.__dict__)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="qwen2_5_1_5b,qwen2_5_7b")
    ap.add_argument("--widths", default="8,24,48,64,96,128")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-widths", default="8,48,128")
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": {}}
    for preset in args.presets.split(","):
        for name, (n, k, has_bias) in matrices(preset).items():
            for width in map(int, args.widths.split(",")):
                row = measure(n, k, has_bias, width, args)
                report["results"][f"{preset}/{name}/{width}"] = row
                print(preset, name, width, json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
