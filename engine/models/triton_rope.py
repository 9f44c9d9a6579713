"""The training forward's rotary embedding as one Triton kernel each way, for megatron's fused-RoPE hooks.

megatron applies RoPE to the query and the key separately (`apply_rotary_pos_emb`), and the compiled
`rope_reference` (engine/models/spec.py) evaluates cos and sin of the angles for every element: every head
of every token recomputes its token's transcendentals, and the packed path first gathers a float32 angle row
per token (`freqs[positions]`). In a 1.5B update that was 2.3% of the kernel time for ~117 MB of q and k per
micro-batch and layer (scripts/bench/README.md, "Update"). Here a program takes a block of tokens and all
heads: it loads each token's angles once (by its position: the row index for sbhd, `positions` for packed
rows), evaluates cos/sin once per (token, feature) and rotates every head with them, in float32, rounding
once to the input's dtype (the compiled path's numerics). The backward is the transposed rotation:
dx1 = dy1 cos(f1) + dy2 sin(f2), dx2 = dy2 cos(f2) - dy1 sin(f1) for the halves (x1, x2) and their angles
(f1, f2).

Full-width rotation (rot_dim = head_dim) and non-interleaved only; `fused_rope` in engine/models/spec.py
takes this path on CUDA and keeps the compiled one otherwise. Parity: tests/engine/interpreted_triton.py
(the interpreter, float16) and tests/engine/test_training_kernels.py (GPU, bf16) against `rope_reference`.
"""

from __future__ import annotations

import torch

from engine.models.triton_support import elementwise_supported, tl, triton

BLOCK_T = 4
"""Tokens per program."""

if triton is not None:

    @triton.jit
    def _rope(
        x_ptr,
        out_ptr,
        freqs_ptr,
        pos_ptr,
        tokens,
        batch,
        heads,
        stride_xs,
        stride_xb,
        stride_xh,
        stride_os,
        stride_ob,
        stride_oh,
        stride_f,
        BACKWARD: tl.constexpr,
        HAS_POS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HALF: tl.constexpr,
    ):
        n = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # token = row * batch + column of (s, b)
        live = n < tokens
        s, b = n // batch, n % batch
        if HAS_POS:
            pos = tl.load(pos_ptr + n, mask=live, other=0)
        else:
            pos = s
        d = tl.arange(0, HALF)
        f = freqs_ptr + pos.to(tl.int64)[:, None] * stride_f + d[None, :]
        f1 = tl.load(f, mask=live[:, None], other=0.0)
        f2 = tl.load(f + HALF, mask=live[:, None], other=0.0)
        c1, s1 = tl.cos(f1)[:, None, :], tl.sin(f1)[:, None, :]  # (tokens, 1, half): shared by every head
        c2, s2 = tl.cos(f2)[:, None, :], tl.sin(f2)[:, None, :]
        h = tl.arange(0, BLOCK_H)
        mask = live[:, None, None] & (h < heads)[None, :, None]
        src = s.to(tl.int64) * stride_xs + b.to(tl.int64) * stride_xb
        src = x_ptr + src[:, None, None] + h[None, :, None] * stride_xh + d[None, None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        dst = s.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob
        dst = out_ptr + dst[:, None, None] + h[None, :, None] * stride_oh + d[None, None, :]
        tl.store(dst, y1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, y2.to(out_ptr.dtype.element_ty), mask=mask)


def supported(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """The kernel applies: Triton runs here for t's device and dtype, the rotation spans the whole head
    (freqs' last size = head_dim, even), unit feature strides."""
    d = t.shape[-1]
    return (
        elementwise_supported(t.device, t.dtype)
        and freqs.shape[-1] == d
        and d % 2 == 0
        and (d // 2) & (d // 2 - 1) == 0  # a power of two per half (tl.arange)
        and t.stride(-1) == 1
    )


def _launch(x: torch.Tensor, freqs2d: torch.Tensor, positions: torch.Tensor | None, backward: bool):
    """x (s, b, heads, dim) any strides with unit feature stride -> a new contiguous tensor, rotated."""
    s, b, heads, dim = x.shape
    out = torch.empty((s, b, heads, dim), dtype=x.dtype, device=x.device)
    tokens = s * b
    if tokens == 0:
        return out
    pos = positions if positions is not None else freqs2d  # unused without HAS_POS
    _rope[(triton.cdiv(tokens, BLOCK_T),)](
        x, out, freqs2d, pos, tokens, b, heads, x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2), freqs2d.stride(0),
        BACKWARD=backward, HAS_POS=positions is not None, BLOCK_T=BLOCK_T,
        BLOCK_H=triton.next_power_of_2(heads), HALF=dim // 2,
    )  # fmt: skip
    return out


class _RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs2d, positions):
        ctx.save_for_backward(freqs2d, positions)
        return _launch(t, freqs2d, positions, backward=False)

    @staticmethod
    def backward(ctx, grad):
        freqs2d, positions = ctx.saved_tensors
        if grad.stride(-1) != 1:  # the kernel reads features at unit stride (autograd passes contiguous ones)
            grad = grad.contiguous()
        return _launch(grad, freqs2d, positions, backward=True), None, None


def rope(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE on t (s, b, heads, dim) with angles freqs (max positions, 1, 1, dim) float32: token (i, j) takes
    row i of freqs, or row positions[i] (positions (s,) int64, packed rows viewed as (total, 1, heads, dim));
    `supported(t, freqs)` must hold. Differentiable in t."""
    freqs2d = freqs.reshape(freqs.shape[0], freqs.shape[-1]).float()
    return _RotaryFunction.apply(t, freqs2d, positions)
