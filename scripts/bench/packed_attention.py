"""Benchmark the packed update's attention alone: one layer's causal attention over a GRPO step's rows, cut
into micro-batches by the trainer's token budget and laid back to back (thd, `engine/roles/dynamic_batch.py`),
forward and backward, per kernel; prints one JSON object.

Kernels (`--kernels`):
- `engine`: what the trainer runs in its steady state (`engine.models.packed_attention.packed_attention`:
  SDPA on views where every row of a micro-batch is as long as the longest, else FlashAttention-2 varlen with
  the key/value groups as they are); equal rows take SDPA from a shape's first call here (the trainer from
  its `CUDNN_FROM_CALL`-th, a few steps into a run), the warm-up call building cuDNN's plans;
- `flash_gqa`: that FlashAttention-2 varlen path alone (`FlashVarlen`), for every micro-batch;
- `varlen_repeat`: torch's `varlen_attn` (FlashAttention-2 varlen) with the key/value groups repeated per query
  head, as torch 2.11's has no `enable_gqa`: the engine's path before;
- `uniform_sdpa`: SDPA on (rows, heads, length, dim) views (cuDNN's attention on an H200), micro-batches whose
  rows are all equally long only (else skipped);
- `padded_sdpa`: every micro-batch copied into a zero-padded (rows, longest) layout (one index copy per tensor
  each way), SDPA there, the rows' tokens copied back: cuDNN's rate on the padding's extra work;
- `fa4`: FlashAttention-4's varlen kernel (`flash_attn.cute.flash_attn_varlen_func`, pip `flash-attn-4`: CuTe
  DSL, with Hopper (SM90) forward and backward kernels) with the key/value groups as they are, where it is
  installed (not a dependency; an `error` entry names what is missing).

`--per-micro-batch`: first (before any other kernel, so shape-keyed plan builds count) each micro-batch alone
through `flash_gqa` and `padded_sdpa`: its first call and the median of later ones (forward + backward), with
its token fill (tokens / (rows x longest)) and score fill (sum L^2 / (rows x longest^2)).

Per kernel: forward and forward + backward milliseconds for the whole step (all micro-batches, one layer;
median of `--iters` after a warm-up), times the preset's layer count, and the causal FLOP rate (forward
2 x 2 x heads x dim x sum L(L+1)/2, backward 2.5x that); parity on the first micro-batch: the largest
absolute error of the output and of dq, dk, dv against float32 SDPA over the rows (`segment_attention` on
float32 copies), next to the flash kernel's own (bf16). On CPU only `engine` and `padded_sdpa` run (SDPA
there), for the plumbing.

    python scripts/bench/packed_attention.py --preset qwen2_5_1_5b                       # fixed 512
    python scripts/bench/packed_attention.py --preset qwen2_5_1_5b --lengths long_tail --response-len 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from gpu_timing import event_ms  # noqa: E402
from presets import attention_dims  # noqa: E402
from workload import add_step_args, response_lengths  # noqa: E402

from engine.models import packed_attention as packed_module  # noqa: E402
from engine.models.packed_attention import segment_attention  # noqa: E402
from engine.roles.dynamic_batch import pack_by_token_budget  # noqa: E402

KERNELS = ("engine", "flash_gqa", "varlen_repeat", "uniform_sdpa", "padded_sdpa", "fa4")


def parse_args(argv=None) -> argparse.Namespace:
    ap = attention_bench_parser(__doc__, KERNELS)
    ap.add_argument("--per-micro-batch", action="store_true")
    return ap.parse_args(argv)


def attention_bench_parser(doc: str, kernels: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options of an attention benchmark (this one, shared_attention.py): a preset, the step's workload,
    the micro-batch budget, the kernels and the timed iterations."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2_5_1_5b")
    add_step_args(ap)
    ap.add_argument("--max-tokens", type=int, default=32768, help="token budget per micro-batch")
    ap.add_argument("--kernels", default=",".join(kernels))
    ap.add_argument("--iters", type=int, default=5)
    return ap


def micro_batch_lengths(args) -> list[list[int]]:
    """Row lengths (prompt + response) per micro-batch, as the trainer packs the step."""
    per_prompt = response_lengths(args.lengths, args.prompts, args.response_len, args.seed)
    lengths = [args.prompt_len + r for r in per_prompt for _ in range(args.n)]
    groups = pack_by_token_budget(lengths, args.max_tokens, packed=True)
    return [[lengths[i] for i in g] for g in groups]


def offsets(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def engine(q, k, v, cu, longest, scale):
    from megatron.core.packed_seq_params import PackedSeqParams

    from engine.models.packed_attention import packed_attention

    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    return packed_attention(q, k, v, params, scale)


def flash_gqa(q, k, v, cu, longest, scale):
    from engine.models.packed_attention import FlashVarlen

    return FlashVarlen.apply(q, k, v, cu, longest, scale)


def varlen_repeat(q, k, v, cu, longest, scale):
    from torch.nn.attention.varlen import varlen_attn

    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0))


def uniform_sdpa(q, k, v, cu, longest, scale):
    from engine.models.packed_attention import uniform_rows_attention

    rows = cu.numel() - 1
    if rows * longest != q.shape[0]:
        raise ValueError("rows of different lengths")
    return uniform_rows_attention(q, k, v, rows, scale, 0.0)


def padded_sdpa(q, k, v, cu, longest, scale):
    from engine.models.packed_attention import uniform_rows_attention

    rows, t = cu.numel() - 1, q.shape[0]
    token = torch.arange(t, device=q.device)
    row = torch.searchsorted(cu[1:], token.to(cu.dtype), right=True)
    slot = row * longest + token - cu[row]  # each packed token's place in the (rows * longest) layout

    def pad(x):
        return x.new_zeros(rows * longest, *x.shape[1:]).index_copy(0, slot, x)

    out = uniform_rows_attention(pad(q), pad(k), pad(v), rows, scale, 0.0)
    return out.index_select(0, slot)


def fa4(q, k, v, cu, longest, scale):
    from flash_attn.cute import flash_attn_varlen_func

    out, _ = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=longest,
        max_seqlen_k=longest,
        softmax_scale=scale,
        causal=True,
    )
    return out


def inputs(lengths, heads, groups, dim, device, dtype, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    t = sum(lengths)
    q, k, v = (
        torch.randn(t, h, dim, device=device, dtype=dtype, generator=gen) for h in (heads, groups, groups)
    )
    return q, k, v, torch.randn(t, heads, dim, device=device, dtype=dtype, generator=gen)


def run(fn, q, k, v, g, cu, longest, scale, backward: bool):
    q, k, v = (x.detach().requires_grad_(backward) for x in (q, k, v))
    out = fn(q, k, v, cu, longest, scale)
    if backward:
        out.backward(g)
        return out, q.grad, k.grad, v.grad
    return (out,)


def timed_ms(fn, batches, scale, backward, iters, device) -> float | None:
    def once():
        for q, k, v, g, cu, longest in batches:
            run(fn, q, k, v, g, cu, longest, scale, backward)

    once()
    if device.type != "cuda":
        return None
    return statistics.median(event_ms(once) for _ in range(iters))


def one_ms(fn, batch, scale) -> float:
    q, k, v, g, cu, longest = batch
    return event_ms(lambda: run(fn, q, k, v, g, cu, longest, scale, backward=True))


def per_micro_batch(batches, mbs, scale, iters) -> list[dict]:
    out = []
    for batch, lengths in zip(batches, mbs):
        longest = max(lengths)
        row = {
            "rows": len(lengths),
            "tokens": sum(lengths),
            "longest": longest,
            "token_fill": sum(lengths) / (len(lengths) * longest),
            "score_fill": sum(n * n for n in lengths) / (len(lengths) * longest**2),
        }
        for name, fn in (("padded_sdpa", padded_sdpa), ("flash_gqa", flash_gqa)):
            row[f"{name}_first_ms"] = one_ms(fn, batch, scale)
            row[f"{name}_ms"] = statistics.median(one_ms(fn, batch, scale) for _ in range(iters))
        out.append(row)
    return out


def parity(fn, batch, scale) -> dict:
    q, k, v, g, cu, longest = batch
    got = run(fn, q, k, v, g, cu, longest, scale, backward=True)
    qf, kf, vf = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    ref_out = segment_attention(qf, kf, vf, cu, cu, scale, 0.0)
    ref_out.backward(g.float())
    ref = (ref_out, qf.grad, kf.grad, vf.grad)
    return max_errors(got, ref)


def max_errors(got, want) -> dict[str, float]:
    """The largest absolute error of the output and of dq, dk, dv."""
    return {
        name: float((a.float() - b).abs().max()) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)
    }


def layer_fields(preset: str, device: torch.device, dtype: torch.dtype) -> dict:
    """The JSON's description of one layer's attention: its dims, dtype and device."""
    heads, groups, dim, layers = attention_dims(preset)
    return {
        "heads": heads,
        "groups": groups,
        "dim": dim,
        "layers": layers,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }


def device_and_dtype() -> tuple[torch.device, torch.dtype]:
    """CUDA in bfloat16 where there is a GPU, else the CPU in float32 (the plumbing)."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def main(argv=None) -> None:
    args = parse_args(argv)
    before = packed_module.CUDNN_FROM_CALL
    packed_module.CUDNN_FROM_CALL = 1  # `engine`'s steady state: every shape past its plan build (docstring)
    try:  # restored after, so an in-process caller (tests/scripts/) keeps the engine's threshold
        measure(args)
    finally:
        packed_module.CUDNN_FROM_CALL = before


def measure(args) -> None:
    """The kernels over the step's micro-batches, printed as one JSON object (module docstring)."""
    heads, groups, dim, layers = attention_dims(args.preset)
    device, dtype = device_and_dtype()
    scale = dim**-0.5
    mbs = micro_batch_lengths(args)
    batches = []
    for i, lengths in enumerate(mbs):
        q, k, v, g = inputs(lengths, heads, groups, dim, device, dtype, args.seed + i)
        batches.append((q, k, v, g, offsets(lengths, device), max(lengths)))
    sum_sq = sum(n * (n + 1) // 2 for lengths in mbs for n in lengths)
    fwd_flops = 2 * 2 * heads * dim * sum_sq
    result = {
        "preset": args.preset,
        "lengths": args.lengths,
        "response_len": args.response_len,
        "rows": sum(len(x) for x in mbs),
        "tokens": sum(map(sum, mbs)),
        "micro_batches": len(mbs),
        "max_tokens": args.max_tokens,
        **layer_fields(args.preset, device, dtype),
        "kernels": {},
    }
    if args.per_micro_batch and device.type == "cuda":
        result["per_micro_batch"] = per_micro_batch(batches, mbs, scale, args.iters)
    for name in args.kernels.split(","):
        if device.type != "cuda" and name not in ("engine", "padded_sdpa"):
            continue
        fn = {
            "engine": engine,
            "flash_gqa": flash_gqa,
            "varlen_repeat": varlen_repeat,
            "uniform_sdpa": uniform_sdpa,
            "padded_sdpa": padded_sdpa,
            "fa4": fa4,
        }[name]
        try:
            err = parity(fn, batches[0], scale)
            fwd = timed_ms(fn, batches, scale, False, args.iters, device)
            both = timed_ms(fn, batches, scale, True, args.iters, device)
        except Exception as e:  # noqa: BLE001 - a kernel the build refuses is a result, not a crash
            result["kernels"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        row = {"max_abs_error": err}
        if both is not None:
            row.update(
                forward_ms=fwd,
                forward_backward_ms=both,
                update_ms_all_layers=both * layers,
                forward_tflops=fwd_flops / fwd / 1e9,
                forward_backward_tflops=3.5 * fwd_flops / both / 1e9,
            )
        result["kernels"][name] = row
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
