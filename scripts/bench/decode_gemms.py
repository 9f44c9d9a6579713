"""The native engine's decode-step GEMMs alone, at a few batch widths, by GEMM backend; prints JSON (GPU only).

    python scripts/bench/decode_gemms.py --preset qwen2_5_1_5b --widths 24,128,512

Each linear layer of a decode step (`F.linear(x (width, in), w (out, in))`, bf16, QKV with its bias) and the
output head, timed as the engine runs them: inside a CUDA graph of 20 calls (CUDA events, median of
`--iters` replays). Backends, same run, same tensors:
- `cublas`: torch's default (`torch.backends.cuda.preferred_blas_library()` as found);
- `cublaslt`: `preferred_blas_library("cublaslt")`;
- `inductor` (`--autotune`): `torch.compile(mode="max-autotune-no-cudagraphs")` of the call, which times
  Triton GEMM templates against cuBLAS for the shape and keeps the fastest;
- `skinny`: the engine's Triton kernel for few rows (engine/rollout/triton_skinny.py) with the tile
  `skinny_config` picks, at widths up to `--skinny-max` rows; `--sweep` also times every tile of a grid
  (column block, feature step, split K, warps and stages) at those widths and reports the best five.
Reported per GEMM: microseconds per call, TFLOP/s, and the weight bytes read per second (TB/s).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F
from gpu_timing import graph_ms  # scripts/bench/ is on sys.path
from presets import hf_config_for

from engine.rollout.triton_skinny import SkinnyConfig, skinny_config, skinny_linear

SWEEP = [
    SkinnyConfig(block_n, block_k, split_k, warps, stages)
    for block_n in (16, 32, 64)
    for block_k in (128, 256, 512)
    for split_k in (1, 2, 4, 8)
    for warps, stages in ((4, 4), (8, 3))
]


def gemm_shapes(cfg: dict) -> dict[str, tuple[int, int, bool]]:
    """name -> (in features, out features, bias) of one decode step's linear layers (TP=1)."""
    h, dim = cfg["hidden_size"], cfg["head_dim"]
    heads, groups, ffn = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    return {
        "qkv": (h, (heads + 2 * groups) * dim, True),
        "proj": (heads * dim, h, False),
        "fc1": (h, 2 * ffn, False),
        "fc2": (ffn, h, False),
        "head": (h, cfg["vocab_size"], False),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2_5_1_5b")
    ap.add_argument("--widths", default="24,128,512")
    ap.add_argument("--gemms", default="qkv,proj,fc1,fc2,head")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--autotune", action="store_true", help="also Inductor's max-autotune GEMM")
    ap.add_argument("--skinny-max", type=int, default=128, help="widest batch the skinny kernel is timed at")
    ap.add_argument("--sweep", default="", help="widths at which every tile of the skinny grid is timed")
    args = ap.parse_args()
    cfg = hf_config_for(args.preset)
    dev, dt = torch.device("cuda"), torch.bfloat16
    found = torch.backends.cuda.preferred_blas_library()
    result = {"preset": args.preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["default_blas"] = str(found)
    rows = []
    shapes = gemm_shapes(cfg)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sweep_widths = {int(x) for x in args.sweep.split(",") if x}
    for name in args.gemms.split(","):
        k, n, bias = shapes[name]
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        b = torch.randn(n, device=dev, dtype=dt) * 0.02 if bias else None
        for width in (int(x) for x in args.widths.split(",")):
            x = torch.randn(width, k, device=dev, dtype=dt)
            row = {"gemm": name, "width": width, "in": k, "out": n}
            ref = F.linear(x, w, b)
            for backend in ("cublas", "cublaslt", "inductor"):
                if backend == "inductor" and not args.autotune:
                    continue
                torch.backends.cuda.preferred_blas_library("cublaslt" if backend == "cublaslt" else found)
                linear = F.linear
                if backend == "inductor":
                    linear = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                fn = functools.partial(linear, x, w, b)
                us = 1e3 * graph_ms(fn, args.iters)
                row[backend + "_us"] = round(us, 2)
                row[backend + "_tflops"] = round(2 * width * k * n / us / 1e6, 1)
                row[backend + "_weight_tb_per_s"] = round(2 * k * n / us / 1e6, 2)
                row[backend + "_max_abs_diff"] = float((fn().float() - ref.float()).abs().max())
            torch.backends.cuda.preferred_blas_library(found)
            if width <= args.skinny_max:
                config = skinny_config(width, n, k, sms)
                row.update(_skinny(x, w, b, ref, config, args.iters, "skinny"))
                row["skinny_config"] = config.__dict__
                row["skinny_over_cublas"] = round(row["skinny_us"] / row["cublas_us"], 3)
            if width in sweep_widths:
                timed = [(_skinny(x, w, b, ref, c, args.iters, "t")["t_us"], c.__dict__) for c in SWEEP]
                timed.sort(key=lambda t: t[0])
                row["sweep_best"] = [{"us": us, **c} for us, c in timed[:5]]
            rows.append(row)
    result["gemms"] = rows
    print(json.dumps(result, indent=1))


def _skinny(x, w, b, ref, config: SkinnyConfig, iters: int, key: str) -> dict:
    """The skinny kernel with one tile, timed in a CUDA graph, with its largest difference from cuBLAS."""
    fn = functools.partial(skinny_linear, x, w, b, config)
    us = 1e3 * graph_ms(fn, iters)
    k, n = w.shape[1], w.shape[0]
    return {
        key + "_us": round(us, 2),
        key + "_weight_tb_per_s": round(2 * k * n / us / 1e6, 2),
        key + "_max_abs_diff": float((fn().float() - ref.float()).abs().max()),
    }


if __name__ == "__main__":
    main()
