"""A decode step's token draw alone: the Triton draw (engine/rollout/triton_sample.py) on the head's
bf16 logits against the torch draw (engine/rollout/sampler.py) on the float32 logits the decode step used to
return (the upcast timed with it, as the step paid it), temperature 1, Qwen2.5's 151,936 columns; prints one
JSON object: microseconds per draw (median of --iters, CUDA events) by batch width, and their ratio.

    python scripts/bench/sampler.py                  # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_timing import eager_ms  # noqa: E402

from engine.rollout.base import SamplingParams  # noqa: E402
from engine.rollout.sampler import sample_tokens  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="8,32,128,512")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sampling = SamplingParams(temperature=1.0)
    gen = torch.Generator(device=dev).manual_seed(0)
    report = {"device": torch.cuda.get_device_name(dev), "vocab": args.vocab, "widths": {}}
    for width in map(int, args.widths.split(",")):
        logits = (torch.randn(width, args.vocab, device=dev) * 2).to(torch.bfloat16)
        fused = 1e3 * eager_ms(lambda x=logits: sample_tokens(x, sampling, gen, fused=True), args.iters)
        torch_draw = 1e3 * eager_ms(lambda x=logits: sample_tokens(x.float(), sampling, gen), args.iters)
        report["widths"][width] = {
            "triton_us": round(fused, 1),
            "torch_us": round(torch_draw, 1),
            "speedup": round(torch_draw / fused, 2),
            "triton_gb_per_s": round(logits.numel() * 2 / fused / 1e3, 1),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
