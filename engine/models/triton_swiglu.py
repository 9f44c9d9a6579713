"""The MLP's gated activation, SwiGLU (silu(y1) * y2 of the fc1 output's two halves), and its backward as Triton
kernels, in place of megatron's torch.compile'd `bias_swiglu_impl` for bias-free MLPs on CUDA.

Why: megatron's backward returns `torch.cat((d y1, d y2), -1)`, which inductor turns into one kernel per
output element that loads y1, y2 and the incoming gradient again for each half: 1.04 ms per call at
32k x 17,920 (Qwen2.5-1.5B) on an H200, about half the bandwidth, ~6% of the 1.5B update (the profile in
scripts/bench/README.md). Here one program owns a block of columns of one row and writes both halves from
one load of each input. The forward (already near bandwidth) runs as a kernel of the same layout so the two
stay one pair. Math in float32, one rounding to the input dtype per output, as inductor computes megatron's.

`install_swiglu_kernels` swaps megatron MLP's `bias_swiglu_impl` for one that takes this path for
bias-free CUDA inputs (the Qwen/Llama MLPs) and hands everything else (a bias, fp8 input store, CPU offload)
to megatron's. engine/models/builder.py installs it where megatron's fused activation runs (CUDA). Parity:
tests/engine/interpreted_triton.py (CPU, Triton's interpreter, float16) and tests/engine/test_training_kernels.py
(GPU, bfloat16, against megatron's compiled kernels).
"""

from __future__ import annotations

import torch

from engine.models.triton_support import elementwise_supported, tl, triton

BLOCK = 1024
"""Columns of one half per program."""

if triton is not None:

    @triton.jit
    def _swiglu_fwd(y_ptr, out_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < half
        y1 = tl.load(y_ptr + row * 2 * half + cols, mask=inside, other=0.0).to(tl.float32)
        y2 = tl.load(y_ptr + row * 2 * half + half + cols, mask=inside, other=0.0).to(tl.float32)
        out = y1 * tl.sigmoid(y1) * y2
        tl.store(out_ptr + row * half + cols, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _swiglu_bwd(g_ptr, y_ptr, dy_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < half
        g = tl.load(g_ptr + row * half + cols, mask=inside, other=0.0).to(tl.float32)
        y1 = tl.load(y_ptr + row * 2 * half + cols, mask=inside, other=0.0).to(tl.float32)
        y2 = tl.load(y_ptr + row * 2 * half + half + cols, mask=inside, other=0.0).to(tl.float32)
        s = tl.sigmoid(y1)
        d1 = g * s * (1.0 + y1 * (1.0 - s)) * y2
        d2 = g * (y1 * s)
        tl.store(dy_ptr + row * 2 * half + cols, d1.to(dy_ptr.dtype.element_ty), mask=inside)
        tl.store(dy_ptr + row * 2 * half + half + cols, d2.to(dy_ptr.dtype.element_ty), mask=inside)


def supported(y: torch.Tensor) -> bool:
    """Where `swiglu` runs (engine/models/triton_support.py `elementwise_supported`)."""
    return elementwise_supported(y.device, y.dtype)


def _grid(rows: int, half: int) -> tuple[int, int]:
    return rows, triton.cdiv(half, BLOCK)


class SwiGLU(torch.autograd.Function):
    """(rows, 2 f) -> silu(y[:, :f]) * y[:, f:] (rows, f); saves its input, as megatron's `SwiGLUFunction`."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        y = y.contiguous()
        rows, half = y.shape[0], y.shape[1] // 2
        out = y.new_empty(rows, half)
        _swiglu_fwd[_grid(rows, half)](y, out, half, BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(y)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        g = g.contiguous()
        rows, half = g.shape
        dy = torch.empty_like(y)
        _swiglu_bwd[_grid(rows, half)](g, y, dy, half, BLOCK=BLOCK, num_warps=4)
        return dy


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SwiGLU over the last dimension of `y` (any leading shape), differentiable."""
    lead = y.shape[:-1]
    return SwiGLU.apply(y.reshape(-1, y.shape[-1])).view(*lead, y.shape[-1] // 2)


def install_swiglu_kernels() -> None:
    """Route megatron MLP's fused SwiGLU through `swiglu` for bias-free inputs it supports. Idempotent."""
    from megatron.core.transformer import mlp

    original = mlp.bias_swiglu_impl
    if getattr(original, "engine_swiglu", False):
        return

    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        if bias is None and not fp8_input_store and not cpu_offload_input and supported(input):
            return swiglu(input)
        return original(input, bias, fp8_input_store, cpu_offload_input)

    bias_swiglu_impl.engine_swiglu = True
    mlp.bias_swiglu_impl = bias_swiglu_impl
