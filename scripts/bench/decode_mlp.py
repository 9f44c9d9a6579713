"""A dense MLP at narrow decode widths: the engine's five-kernel chain against engine/rollout/triton_mlp.py's
two kernels; prints JSON (GPU only).

    python scripts/bench/decode_mlp.py --preset qwen2_5_1_5b --widths 1,8,16,32,64     # bash run.sh decode_mlp

Per width, over every layer's own weights (random, bf16; no layer's weights stay in L2 for the next), inside a
CUDA graph (gpu_timing.graph_ms: median of replays), microseconds per layer of:
- `unfused`: residual add + RMSNorm (compiled), fc1 (cuBLAS), SwiGLU (compiled), fc2 (cuBLAS), and the next
  residual add + RMSNorm (compiled): the engine's chain;
- `triton`: the same norms, the MLP as `fc1_swiglu` + `fc2` (the best of a tile sweep, each kernel swept alone
  first; the next norm adds fc2's split partials).
Also each sweep's kernels alone, cuBLAS's fc1 and fc2 alone, a read of each layer's fc1 weight (`read_us`: a
float32 sum, the rate a kernel that only streams the weight reaches), the weight bytes per second of each MLP,
and `triton`'s largest difference from `unfused` (the next norm's output).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from gpu_timing import graph_ms  # scripts/bench/ is on sys.path
from presets import hf_config_for

from engine.models.compiled import cuda_kernel
from engine.rollout import triton_mlp
from engine.rollout.model import add_partials_rms_norm, add_rms_norm, swiglu

COMPILE = "ENGINE_COMPILE_ROLLOUT"
FC1_TILES = [
    dict(block_f=f, block_k1=k, warps1=w, stages1=s)
    for f in (16, 32, 64)
    for k, w, s in ((128, 4, 4), (128, 4, 3), (64, 4, 6), (128, 8, 4))
]
FC2_TILES = [
    dict(block_n=n, block_k2=k, split=sp, warps2=4, stages2=st)
    for n, k, sp, st in (
        (16, 256, 1, 3),
        (32, 256, 2, 3),
        (32, 128, 2, 4),
        (32, 128, 4, 4),
        (32, 256, 4, 3),
        (16, 128, 4, 4),
        (64, 128, 4, 3),
        (32, 128, 8, 4),
        (16, 128, 8, 4),
    )
]


def _or_inf(per_layer, fn) -> float:
    """`per_layer(fn)`, or infinity where the tile does not fit the GPU (Triton's OutOfResources)."""
    try:
        return per_layer(fn)
    except Exception as e:  # noqa: BLE001 (triton.runtime.errors.OutOfResources and compile failures)
        print(f"skipped a tile: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return float("inf")


def bench_width(width: int, fc1: list, fc2: list, norm_w: torch.Tensor, iters: int) -> dict:
    """One width's row: cuBLAS alone, the two sweeps, the three chains (module docstring)."""
    hidden, ffn, n_layers = fc2[0].shape[0], fc2[0].shape[1], len(fc1)
    dev, dt, eps = norm_w.device, norm_w.dtype, 1e-6
    add_norm, act = cuda_kernel(add_rms_norm, dev, COMPILE), cuda_kernel(swiglu, dev, COMPILE)
    add_parts = cuda_kernel(add_partials_rms_norm, dev, COMPILE)
    x = torch.randn(width, hidden, device=dev, dtype=dt)
    d = torch.randn(width, hidden, device=dev, dtype=dt)
    h = add_norm(x, d, norm_w, eps)[1]
    mid = act(F.linear(h, fc1[0]))

    def per_layer(fn) -> float:
        return round(1e3 * graph_ms(lambda: [fn(i) for i in range(n_layers)], iters, reps=3) / n_layers, 2)

    row: dict = {"width": width}
    row["cublas_fc1_us"] = per_layer(lambda i: F.linear(h, fc1[i]))
    row["cublas_fc2_us"] = per_layer(lambda i: F.linear(mid, fc2[i]))
    row["read_us"] = per_layer(lambda i: fc1[i].sum(dtype=torch.float32))
    sweep1, sweep2 = [], []
    for t in FC1_TILES:
        tiles1 = triton_mlp.MlpTiles(**t)
        sweep1.append((_or_inf(per_layer, lambda i, t1=tiles1: triton_mlp.fc1_swiglu(h, fc1[i], t1)), t))
    for t in FC2_TILES:
        tiles2 = triton_mlp.MlpTiles(**t)
        sweep2.append((_or_inf(per_layer, lambda i, t2=tiles2: triton_mlp.fc2(mid, fc2[i], t2)), t))
    best1, best2 = min(sweep1, key=lambda r: r[0]), min(sweep2, key=lambda r: r[0])
    row["fc1_swiglu_sweep"] = [{"us": us, **t} for us, t in sweep1]
    row["fc2_sweep"] = [{"us": us, **t} for us, t in sweep2]
    tiles = triton_mlp.MlpTiles(**best1[1], **best2[1])
    row["tiles"] = {**best1[1], **best2[1]}

    def unfused(i: int) -> torch.Tensor:
        s, hn = add_norm(x, d, norm_w, eps)
        return add_norm(s, F.linear(act(F.linear(hn, fc1[i])), fc2[i]), norm_w, eps)[1]

    def fused(i: int) -> torch.Tensor:
        s, hn = add_norm(x, d, norm_w, eps)
        out = triton_mlp.dense_mlp(hn, fc1[i], fc2[i], tiles)
        return (add_parts if out.dim() > s.dim() else add_norm)(s, out, norm_w, eps)[1]

    ref = unfused(0).float()
    for name, fn in (("unfused", unfused), ("triton", fused)):
        row[name + "_us"] = per_layer(fn)
        row[name + "_max_abs_diff"] = float((fn(0).float() - ref).abs().max())
    row["triton_over_unfused"] = round(row["triton_us"] / row["unfused_us"], 3)
    mlp_us = {"cublas": row["cublas_fc1_us"] + row["cublas_fc2_us"], "triton": best1[0] + best2[0]}
    row["mlp_weight_tb_per_s"] = {k: round(3 * hidden * ffn * 2 / v / 1e6, 2) for k, v in mlp_us.items()}
    row["read_tb_per_s"] = round(2 * hidden * ffn * 2 / row["read_us"] / 1e6, 2)
    return row


def bench_preset(preset: str, widths: list[int], iters: int) -> dict:
    cfg = hf_config_for(preset)
    hidden, ffn, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    dev, dt = torch.device("cuda"), torch.bfloat16
    fc1 = [torch.randn(2 * ffn, hidden, device=dev, dtype=dt) * 0.02 for _ in range(n_layers)]
    fc2 = [torch.randn(hidden, ffn, device=dev, dtype=dt) * 0.02 for _ in range(n_layers)]
    norm_w = 1 + 0.1 * torch.randn(hidden, device=dev, dtype=dt)
    out = {"preset": preset, "hidden": hidden, "ffn": ffn, "layers": n_layers, "widths": []}
    for width in widths:
        row = bench_width(width, fc1, fc2, norm_w, iters)
        print(json.dumps(row), file=sys.stderr)
        out["widths"].append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2_5_1_5b")
    ap.add_argument("--widths", default="1,8,16,32,64")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result.update(bench_preset(args.preset, widths, args.iters))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
