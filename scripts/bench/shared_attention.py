"""Benchmark the attention of the shared-prompt layout alone (trainer.share_prompts): one layer over a GRPO
step (every prompt `--prompt-len` tokens, `--n` responses each of `--response-len`, or long-tailed lengths,
one per prompt, as `workload.py` draws them), cut into micro-batches as the trainer cuts it
(engine/roles/dynamic_batch.py `MicroBatcher`, `--max-tokens` per micro-batch), forward and backward, per
kernel; prints one JSON object.

Kernels (`--kernels`):
- `gathered`: each response's keys a copy of its prompt's then its own (`GatherRows`), FlashAttention-2 varlen
  with the causal mask aligned to the keys' end (engine/models/shared_prompt_attention.py): the path before
  the split;
- `split_cudnn`: the prompts and the responses as dense batches through cuDNN, each response's two parts
  merged by their log-sum-exps (engine/models/shared_prompt_split.py `split_attention`): micro-batches of one
  shape only (a unit count that leaves a last, smaller micro-batch gives it a second shape);
- `split_flash`: the same split through FlashAttention-2 varlen (`varlen_split_attention`): any micro-batch;
- `whole_rows`: the same rows packed whole (each prompt once per row) through SDPA on (rows, heads, length,
  dim) views (cuDNN), fixed lengths only: the layout without sharing.

Per kernel: forward and forward + backward milliseconds for the step (all micro-batches, one layer; median
of `--iters` after a warm-up that builds cuDNN's plans), times the preset's layer count; on CUDA what the
first use costs once, in wall milliseconds: the split's device check (`check_ms`, `split_available`) and the
first forward and backward over the step's micro-batches (`first_forward_backward_ms`: plan builds and the
merge's compile, run in this order: `gathered`, `split_cudnn`, `split_flash`, `whole_rows`, so the merge
compiles under `split_cudnn`); parity on the first micro-batch: the largest absolute error of the output
and of dq, dk, dv against float32 attention over the gathered keys. On CPU the kernels run their float references (SDPA, `MATH`, `MATH_VARLEN`), for the plumbing.

    python scripts/bench/shared_attention.py --preset qwen2_5_1_5b
    python scripts/bench/shared_attention.py --preset qwen2_5_1_5b --lengths long_tail --response-len 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from gpu_timing import event_ms  # noqa: E402
from packed_attention import attention_bench_parser, device_and_dtype, layer_fields, max_errors  # noqa: E402
from presets import attention_dims  # noqa: E402
from workload import response_lengths  # noqa: E402

from engine.models.lse_kernels import CUDNN, FLASH_VARLEN, MATH, MATH_VARLEN  # noqa: E402
from engine.models.packed_attention import FlashVarlen, segment_attention, uniform_rows_attention  # noqa: E402
from engine.models.shared_prompt_attention import GatherRows  # noqa: E402
from engine.models.shared_prompt_split import (  # noqa: E402
    split_attention,
    split_available,
    varlen_split_attention,
)
from engine.roles.dynamic_batch import MicroBatcher  # noqa: E402
from engine.step.batch import build_experience  # noqa: E402

KERNELS = ("gathered", "split_cudnn", "split_flash", "whole_rows")


def parse_args(argv=None) -> argparse.Namespace:
    return attention_bench_parser(__doc__, KERNELS).parse_args(argv)


def shared_params(args, device: torch.device) -> list:
    """The step's shared-prompt micro-batches' `SharedPromptSeqParams`, as the trainer builds them."""
    rows = args.prompts * args.n
    # distinct prompts (the trainer groups rows by their prompt's tokens): p's base-50 digits, then padding
    prompts = [[4 + (p // 50**j) % 50 for j in range(args.prompt_len)] for p in range(args.prompts)]
    per_prompt = response_lengths(args.lengths, args.prompts, args.response_len, args.seed)
    lengths = torch.tensor(per_prompt).repeat_interleave(args.n)
    mask = (torch.arange(args.response_len) < lengths[:, None]).float()
    exp = build_experience(
        prompts,
        torch.full((rows, args.response_len), 5) * mask.long(),
        mask,
        list(range(args.prompts)),
        args.n,
        0,
    )
    exp.tensors["advantages"] = mask.clone()
    batcher = MicroBatcher(args.n, args.max_tokens, 1, device, pack=True, share_prompts=True)
    return [mb["packed_seq_params"] for mb in batcher(exp, torch.arange(rows), ("advantages",))]


def gathered(q, k, v, p, scale):
    k_seg, v_seg = GatherRows.apply(k, p.kv_index), GatherRows.apply(v, p.kv_index)
    if q.is_cuda:
        return FlashVarlen.apply(q, k_seg, v_seg, p.cu_seqlens_q, p.max_q, scale, p.cu_seqlens_k, p.max_k)
    return segment_attention(q, k_seg, v_seg, p.cu_seqlens_q, p.cu_seqlens_k, scale, 0.0)


def split_cudnn(q, k, v, p, scale):
    if p.uniform is None:
        raise ValueError("a micro-batch of more than one shape")
    return split_attention(q, k, v, p.uniform, scale, CUDNN if q.is_cuda else MATH)


def split_flash(q, k, v, p, scale):
    kernel = FLASH_VARLEN if q.is_cuda else MATH_VARLEN
    return varlen_split_attention(q, k, v, p.cu_seqlens_q, p.max_q, p.cross, scale, kernel)


def whole_rows(q, k, v, p, scale):
    if p.uniform is None:
        raise ValueError("rows of different lengths")
    return uniform_rows_attention(q, k, v, q.shape[0] // p.max_seqlen_q, scale, 0.0)


def tokens(p, kernel: str) -> int:
    """The micro-batch's tokens: shared, or its rows whole for `whole_rows` (fixed lengths)."""
    if kernel != "whole_rows" or p.uniform is None:
        return int(p.cu_seqlens_q[-1])
    g, n, prompt, response = p.uniform
    return g * n * (prompt + response)


def inputs(t: int, heads: int, groups: int, dim: int, device, dtype, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randn(t, h, dim, device=device, dtype=dtype, generator=gen)
        for h in (heads, groups, groups, heads)
    ]


def run(fn, q, k, v, g, p, scale, backward: bool):
    q, k, v = (x.detach().requires_grad_(backward) for x in (q, k, v))
    out = fn(q, k, v, p, scale)
    if backward:
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), g))
    return (out.detach(),)


def timed_ms(fn, batches, scale, backward: bool, iters: int) -> float:
    def once():
        for q, k, v, g, p in batches:
            run(fn, q, k, v, g, p, scale, backward)

    once()
    return statistics.median(event_ms(once) for _ in range(iters))


def reference(q, k, v, p, scale):
    """Float32 attention over the gathered keys, segment by segment (any device)."""
    k_seg, v_seg = k[p.kv_index], v[p.kv_index]
    return segment_attention(q, k_seg, v_seg, p.cu_seqlens_q, p.cu_seqlens_k, scale, 0.0)


def parity(fn, batch, scale) -> dict:
    q, k, v, g, p = batch
    got = run(fn, q, k, v, g, p, scale, backward=True)
    want = run(reference, *(x.float() for x in (q, k, v, g)), p, scale, backward=True)
    return max_errors(got, want)


def first_call_ms(fn, batches, scale) -> float:
    """Wall milliseconds of the kernel's first forward and backward over the step's micro-batches: what a run
    pays once (cuDNN's plans, the merge's compile, FlashAttention's first launch) plus one step's work."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for q, k, v, g, p in batches:
        run(fn, q, k, v, g, p, scale, backward=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def check_ms(kernel, batch) -> float:
    """Wall milliseconds of the split's device check (`split_available`, once per kernel and layout)."""
    q, k, v = batch[:3]
    torch.cuda.synchronize()
    start = time.perf_counter()
    ok = split_available(q, k, v, kernel)
    torch.cuda.synchronize()
    if not ok:
        raise RuntimeError(f"{kernel} failed split_available's check on this device")
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> None:
    args = parse_args(argv)
    heads, groups, dim, layers = attention_dims(args.preset)
    device, dtype = device_and_dtype()
    scale = dim**-0.5
    params = shared_params(args, device)
    result = {
        "preset": args.preset,
        "prompts": args.prompts,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "lengths": args.lengths,
        "max_tokens": args.max_tokens,
        "micro_batches": len(params),
        "shapes": sorted({p.uniform for p in params}, key=str),
        **layer_fields(args.preset, device, dtype),
        "kernels": {},
    }
    for name in args.kernels.split(","):
        fn = {
            "gathered": gathered,
            "split_cudnn": split_cudnn,
            "split_flash": split_flash,
            "whole_rows": whole_rows,
        }[name]
        batches = [
            (*inputs(tokens(p, name), heads, groups, dim, device, dtype, i), p) for i, p in enumerate(params)
        ]
        try:
            row = {"tokens": sum(tokens(p, name) for p in params)}
            if name != "whole_rows":
                row["max_abs_error"] = parity(fn, batches[0], scale)
            if device.type == "cuda":
                if name in ("split_cudnn", "split_flash"):
                    row["check_ms"] = check_ms(CUDNN if name == "split_cudnn" else FLASH_VARLEN, batches[0])
                row["first_forward_backward_ms"] = first_call_ms(fn, batches, scale)
                fwd, both = (timed_ms(fn, batches, scale, b, args.iters) for b in (False, True))
                row.update(forward_ms=fwd, forward_backward_ms=both, update_ms_all_layers=both * layers)
        except Exception as e:  # noqa: BLE001 - a kernel the build refuses is a result, not a crash
            row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        result["kernels"][name] = row
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
