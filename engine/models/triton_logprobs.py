"""The fused output head's kernels (engine/models/fused_logprobs.py) in Triton, each one pass over a chunk's
bf16 logits: the forward's per-row statistics (`row_stats`: max, the two sums of the log-sum-exp and the
entropy, the target's logit) and the backward's gradient of the logits from the gradients of log p(target)
and of the entropy (`grad_logits`).

Why not torch.compile: the head compiles its kernels with every size symbolic (one compile for every chunk
and vocabulary size), so inductor's elementwise kernel over the flattened (rows, vocab) chunk splits each
element's index into row and column by dividing by a runtime vocabulary size: a 1,413 x 151,936 chunk took
0.9 ms on an H200, about a fifth of the bandwidth (the update profiles in scripts/bench/README.md). Here
each program owns one row's block of columns, so the row index is the program's and nothing is divided. The
forward's compiled reductions were as slow (the sums' kernel: 1.1 ms per such chunk on an H100, a ninth of
the bandwidth, 9% of the 0.5B update) and read the chunk twice (the max, then the sums against it): `row_stats`
reads it once, each row's program folding its blocks into a running max and rescaling its sums.

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

    @triton.jit
    def _row_stats_kernel(
        logits_ptr,
        stats_ptr,
        target_ptr,
        inv_t,
        pad_from,
        n_rows,
        n_cols,
        stride_row,
        masked_logit,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        m = tl.zeros((), tl.float32) + masked_logit  # finite: (m - m_new) * s never meets inf * 0
        s = tl.zeros((), tl.float32)
        a = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_cols
            x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
            z = tl.where(inside & (cols < pad_from), x * inv_t, masked_logit)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            d = z - m_new
            e = tl.exp(d)
            alpha = tl.exp(m - m_new)
            a = alpha * (a + (m - m_new) * s) + tl.sum(e * d, axis=0)
            s = alpha * s + tl.sum(e, axis=0)
            m = m_new
        target = tl.load(target_ptr + row)
        z_t = tl.load(base + tl.maximum(target, 0)).to(tl.float32) * inv_t
        tl.store(stats_ptr + row, m)
        tl.store(stats_ptr + n_rows + row, s)
        tl.store(stats_ptr + 2 * n_rows + row, a)
        tl.store(stats_ptr + 3 * n_rows + row, tl.where(target >= 0, z_t, 0.0))


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Where `grad_logits` runs (engine/models/triton_support.py `elementwise_supported`)."""
    return elementwise_supported(device, dtype)


def _targets(local_t: torch.Tensor, in_shard: torch.Tensor) -> torch.Tensor:
    """Each row's target column on this rank's vocabulary slice, -1 where it is on another rank's (both
    kernels' convention)."""
    return torch.where(in_shard, local_t, -1).contiguous()


def grad_logits(logits, shift, ent, g_logp, g_ent, local_t, in_shard, inv_t: float, pad_from: int):
    """fused_logprobs `_grad_logits`: dL/dlogits (rows, vocab_local) in the logits' dtype, for contiguous
    logits and per-row (rows,) float32 statistics and gradients (already divided by the temperature)."""
    rows, cols = logits.shape
    logits = logits.contiguous()
    out = torch.empty_like(logits)
    target = _targets(local_t, in_shard)
    per_row = [t.float().contiguous() for t in (shift, ent, g_logp, g_ent)]
    grid = (rows, triton.cdiv(cols, BLOCK))
    _grad_logits_kernel[grid](
        logits,
        out,
        *per_row,
        target,
        inv_t,
        pad_from,
        cols,
        cols,
        MASKED_LOGIT,
        BLOCK=BLOCK,
        num_warps=8,
    )
    return out


STATS_BLOCK = 4096
"""Columns per step of `row_stats`'s loop over a row."""


def row_stats(logits, local_t, in_shard, inv_t: float, pad_from: int) -> torch.Tensor:
    """fused_logprobs `_local_stats` in one pass over a chunk's logits, one program per row: (4, rows) float32,
    the row's max m of the scaled logits z (TP-padding columns at MASKED_LOGIT), S = sum exp(z - m),
    A = sum exp(z - m)(z - m) (an online log-sum-exp: each block's terms rescaled to the running max), and
    the target's z (0 where the target is on another rank's vocabulary slice)."""
    rows, cols = logits.shape
    logits = logits.contiguous()
    stats = torch.empty(4, rows, dtype=torch.float32, device=logits.device)
    target = _targets(local_t, in_shard)
    _row_stats_kernel[(rows,)](
        logits,
        stats,
        target,
        inv_t,
        pad_from,
        rows,
        cols,
        cols,
        MASKED_LOGIT,
        BLOCK=STATS_BLOCK,
        num_warps=8,
    )
    return stats
