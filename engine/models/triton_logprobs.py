"""The fused output head's backward kernel (engine/models/fused_logprobs.py `_grad_logits`) in Triton: the
gradient of one chunk of logits from the gradients of log p(target) and of the entropy, one pass over the
chunk's bf16 logits.

Why not torch.compile: the head compiles its kernels with every size symbolic (one compile for every chunk
and vocabulary size), so inductor's elementwise kernel over the flattened (rows, vocab) chunk splits each
element's index into row and column by dividing by a runtime vocabulary size: a 1,413 x 151,936 chunk took
0.9 ms on an H200, about a fifth of the bandwidth (the update profiles in scripts/bench/README.md). Here
each program owns one row's block of columns, so the row index is the program's and nothing is divided.

On CUDA (any float dtype), or under Triton's interpreter on CPU in float16 (tests/engine/interpreted_triton.py);
fused_logprobs.py falls back to the compiled or eager `_grad_logits` elsewhere. Same math, op for op in
float32; parity: tests/engine/interpreted_triton.py (CPU) and tests/engine/test_fused_logprobs.py (GPU).
"""

from __future__ import annotations

import torch

from engine.models.logprobs import MASKED_LOGIT
from engine.models.triton_support import elementwise_supported, tl, triton

BLOCK = 2048
"""Columns per program."""

if triton is not None:

    @triton.jit
    def _grad_logits_kernel(
        logits_ptr,
        out_ptr,
        shift_ptr,
        ent_ptr,
        g_logp_ptr,
        g_ent_ptr,
        target_ptr,
        inv_t,
        pad_from,
        n_cols,
        stride_row,
        masked_logit,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(logits_ptr + row * stride_row + cols, mask=inside, other=0.0).to(tl.float32)
        logp = tl.where(cols < pad_from, x * inv_t, masked_logit) - tl.load(shift_ptr + row)
        g_logp = tl.load(g_logp_ptr + row)
        coef = g_logp + tl.load(g_ent_ptr + row) * (logp + tl.load(ent_ptr + row))
        onehot = tl.where(cols == tl.load(target_ptr + row), g_logp, 0.0)
        grad = onehot - tl.exp(logp) * coef
        tl.store(out_ptr + row * stride_row + cols, grad.to(out_ptr.dtype.element_ty), mask=inside)


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Where `grad_logits` runs (engine/models/triton_support.py `elementwise_supported`)."""
    return elementwise_supported(device, dtype)


def grad_logits(logits, shift, ent, g_logp, g_ent, local_t, in_shard, inv_t: float, pad_from: int):
    """fused_logprobs `_grad_logits`: dL/dlogits (rows, vocab_local) in the logits' dtype, for contiguous
    logits and per-row (rows,) float32 statistics and gradients (already divided by the temperature)."""
    rows, cols = logits.shape
    logits = logits.contiguous()
    out = torch.empty_like(logits)
    target = torch.where(in_shard, local_t, -1)  # -1: the target is on another rank's vocabulary slice
    per_row = [t.float().contiguous() for t in (shift, ent, g_logp, g_ent)]
    grid = (rows, triton.cdiv(cols, BLOCK))
    _grad_logits_kernel[grid](
        logits,
        out,
        *per_row,
        target.contiguous(),
        inv_t,
        pad_from,
        cols,
        cols,
        MASKED_LOGIT,
        BLOCK=BLOCK,
        num_warps=8,
    )
    return out
