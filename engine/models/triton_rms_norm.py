"""The training RMSNorm with its weight, forward and backward, as one Triton kernel each way.

The fused RMSNorm of engine/models/spec.py was torch's `F.rms_norm` followed by the weight product, and autograd
then ran the weight product's backward twice over (dy x weight, dy x normalised, then a reduction for the
weight's gradient) before torch's norm backward: five passes over the activations and a saved copy of the
normalised activations per norm, for a norm that needs one read of x and dy. In the 1.5B update's profile these
elementwise kernels were ~4% of the GPU time (scripts/bench/README.md, "Update").

Forward, one program per row: x in float32, rstd = 1 / sqrt(mean(x^2) + eps), the normalised row rounded once
to x's dtype and times the weight, rounded again (Hugging Face's Llama/Qwen numerics, as `F.rms_norm` and then
`weight *` compute them); rstd is kept (float32, one per row) instead of the normalised activations.
Backward, each program over a strided set of rows: dn = dy x weight in float32, dx = rstd (dn - xhat mean(dn
xhat)), and the weight's gradient as per-program float32 partial sums of dy x (the normalised row as the forward
rounded it), summed over the programs once. Unlike autograd's chain, dn and the products are not rounded to
the activation dtype before use: at most one rounding of difference per element.

CUDA with Triton (or its interpreter on CPU, float16). Parity: tests/engine/interpreted_triton.py (CPU) and
tests/engine/test_training_kernels.py (GPU, bf16), each against a float32 autograd of the reference chain.
"""

from __future__ import annotations

import torch

from engine.models.triton_support import elementwise_supported, sm_count, tl, triton

if triton is not None:

    @triton.jit
    def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, hidden, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < hidden
        x = tl.load(x_ptr + row * hidden + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
        n = (x * rstd).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * hidden + cols, (n.to(tl.float32) * w).to(y_ptr.dtype.element_ty), mask=inside)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _rms_norm_bwd(
        x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_part_ptr, rows, hidden, programs, BLOCK: tl.constexpr
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < hidden
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for row in range(pid, rows, programs):
            at = tl.cast(row, tl.int64) * hidden + cols
            x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + at, mask=inside, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            xhat = x * rstd
            dn = dy * w
            dx = rstd * (dn - xhat * (tl.sum(dn * xhat, axis=0) / hidden))
            tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=inside)
            dw += dy * xhat.to(dx_ptr.dtype.element_ty).to(tl.float32)
        tl.store(dw_part_ptr + pid * hidden + cols, dw, mask=inside)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where the kernels run: `elementwise_supported` for x's device and dtype, a contiguous weight of x's dtype,
    and a row of at most 16,384 features (one program holds a row)."""
    return (
        elementwise_supported(x.device, x.dtype)
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and 0 < x.shape[-1] <= 16384
    )


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden).contiguous()
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(hidden)
        if x2.shape[0]:
            _rms_norm_fwd[(x2.shape[0],)](
                x2, weight, y, rstd, hidden, eps, BLOCK=block, num_warps=_warps(block)
            )
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        rows, hidden = x2.shape
        dy2 = dy.reshape(-1, hidden).contiguous()
        dx = torch.empty_like(x2)
        programs = max(1, min(rows, 4 * sm_count(x2.device)))
        part = torch.empty(programs, hidden, dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(hidden)
        if rows:
            _rms_norm_bwd[(programs,)](
                x2, weight, dy2, rstd, dx, part, rows, hidden, programs, BLOCK=block, num_warps=_warps(block)
            )
        else:
            part.zero_()
        return dx.view(dy.shape), part.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_normalize(x) over the last dim, by the Triton kernels (where `supported`), with autograd."""
    return _RMSNorm.apply(x, weight, eps)
