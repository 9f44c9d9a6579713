"""The native engine's decode-step GEMMs alone, at a few batch widths, by GEMM backend; prints JSON (GPU only).

    python scripts/bench/decode_gemms.py --preset qwen2_5_1_5b --widths 24,128,512

Each linear layer of a decode step (`F.linear(x (width, in), w (out, in))`, bf16, QKV with its bias) and the
output head, timed as the engine runs them: inside a CUDA graph of 20 calls (CUDA events, median of
`--iters` replays). Backends, same run, same tensors:
- `cublas`: torch's default (`torch.backends.cuda.preferred_blas_library()` as found);
- `cublaslt`: `preferred_blas_library("cublaslt")`;
- `inductor` (`--autotune`): `torch.compile(mode="max-autotune-no-cudagraphs")` of the call, which times
  Triton GEMM templates against cuBLAS for the shape and keeps the fastest.
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
    args = ap.parse_args()
    cfg = hf_config_for(args.preset)
    dev, dt = torch.device("cuda"), torch.bfloat16
    found = torch.backends.cuda.preferred_blas_library()
    result = {"preset": args.preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["default_blas"] = str(found)
    rows = []
    shapes = gemm_shapes(cfg)
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
            rows.append(row)
    result["gemms"] = rows
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
