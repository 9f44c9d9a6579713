"""Weight gradients summed into megatron's float32 `main_grad` by the GEMM that computes them.

Without apex or TransformerEngine, megatron's linear layers compute each weight gradient as a bf16 tensor
and its DDP hook then adds that tensor to the float32 `main_grad` buffer, one mixed-dtype elementwise pass
per weight per micro-batch (bf16 read, float32 read and write); the fused output head did the same per
chunk of rows. Here the product goes into `main_grad` through the GEMM's epilogue (C = A B + C with a
float32 C, bf16 inputs), as apex's `fused_weight_gradient_mlp_cuda` does: no bf16 copy of the gradient,
no extra pass, and the product is not rounded to bf16 before it is summed.

`install_wgrad_fusion` gives megatron's `tensor_parallel.layers` that kernel under apex's name, so
`TransformerConfig(gradient_accumulation_fusion=True)` runs it (engine/models/builder.py turns it on for
CUDA; on CPU megatron's fused path allocates its placeholder gradients on the current CUDA device, so it
stays off there). The output head (engine/models/fused_logprobs.py) calls `accumulate_matmul` itself.
"""

from __future__ import annotations

import types

import torch


def accumulate_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b in place. Same dtypes: one `addmm_`. A float32 `out` with half-precision `a`, `b` on
    CUDA: one GEMM with float32 output and `out` as its addend (torch's `out_dtype`); elsewhere (CPU, or a
    torch without `out_dtype`) the product in the inputs' dtype, then added."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    elif out.is_cuda and _has_out_dtype():
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out.add_(a @ b)


def _has_out_dtype() -> bool:
    """torch >= 2.8 has `addmm(..., out_dtype=)` (CUDA: half-precision inputs, float32 output)."""
    return hasattr(torch.ops.aten.addmm, "dtype_out")


def _wgrad_gemm_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's contract: main_grad (out, in) += grad_output (tokens, out)^T @ total_input (tokens, in)."""
    accumulate_matmul(main_grad, grad_output.t(), total_input)


FUSED_WGRAD = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=_wgrad_gemm_accum, wgrad_gemm_accum_fp16=_wgrad_gemm_accum
)
"""Stands in for apex's `fused_weight_gradient_mlp_cuda` module (the two functions megatron calls)."""


def install_wgrad_fusion() -> None:
    """Make megatron's linear layers accept `gradient_accumulation_fusion=True` without apex: their module
    reads `fused_weight_gradient_mlp_cuda` at call time and checks `_grad_accum_fusion_available` when a
    layer is built. Idempotent; apex's kernel, when installed, is left in place."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = FUSED_WGRAD
        layers._grad_accum_fusion_available = True
