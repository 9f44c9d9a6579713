"""A column-parallel linear layer whose bias is added by its GEMM (the fused QKV projection of Qwen-style models).

megatron's `LinearWithGradAccumulationAndAsyncCommunication` computes `matmul(x, W^T)` and then `output + bias`:
a separate broadcast add over the whole (tokens, out) output that runs as torch's non-vectorised elementwise
kernel. In the Qwen2.5-1.5B update it took 171 us per layer and 32k-token micro-batch, ~62 ms per update
(scripts/bench/README.md, "what runs outside the 1.5B update's GEMMs"). `F.linear(x, W, b)` folds the bias into
the GEMM's epilogue instead (cuBLASLt's bias epilogue on CUDA: no extra pass, and the sum is rounded once
instead of twice).

`BiasInGemmColumnParallelLinear` takes that path where it is the same computation: a bias, no sequence
parallelism (whose all-gather megatron's forward does itself) and no deferred embedding gradients. With grad
and a trainable weight it runs `_LinearBiasInGemm`, megatron's autograd function with only its forward replaced
(the backward, with its weight-gradient fusion, tensor-parallel all-reduce and bias gradient, is megatron's);
without grad a plain `F.linear`; elsewhere megatron's own path. Parity with megatron's layer:
tests/engine/test_bias_epilogue.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    LinearWithGradAccumulationAndAsyncCommunication,
)


class _LinearBiasInGemm(LinearWithGradAccumulationAndAsyncCommunication):
    """megatron's linear function (no sequence parallelism, no gradient-output buffer) with the bias added by
    the GEMM; the context it saves is what megatron's inherited `backward` reads."""

    @staticmethod
    @megatron_layers.custom_fwd
    def forward(
        ctx,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        tp_group,
    ):
        ctx.save_for_backward(input, weight)
        use_main_grad = gradient_accumulation_fusion and hasattr(weight, "main_grad")
        ctx.main_grad = weight.main_grad if use_main_grad else None
        ctx.use_bias = True
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = False
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.grad_output_buffer = None
        ctx.tp_group = tp_group
        return F.linear(input, weight, bias)


class BiasInGemmColumnParallelLinear(ColumnParallelLinear):
    """megatron's `ColumnParallelLinear` with its bias added by the GEMM where that is the same computation
    (module docstring); the same parameters, state dict and backward."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        bias = kwargs.get("bias")
        deferred = kwargs.get("grad_output_buffer") is not None  # megatron's deferred weight gradients
        if args or bias is None or kwargs.get("sequence_parallel") or deferred:
            return super()._forward_impl(input, weight, *args, **kwargs)
        if not torch.is_grad_enabled():
            return F.linear(input, weight, bias)
        if not weight.requires_grad:
            return super()._forward_impl(input, weight, *args, **kwargs)
        return _LinearBiasInGemm.apply(
            input,
            weight,
            bias,
            kwargs["gradient_accumulation_fusion"],
            kwargs["allreduce_dgrad"],
            False,
            None,
            kwargs.get("wgrad_deferral_limit"),
            kwargs.get("tp_group"),
        )
