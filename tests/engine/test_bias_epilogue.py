"""The QKV projection with its bias added by the GEMM (engine/models/bias_epilogue.py) against megatron's own
`ColumnParallelLinear` (GEMM, then `output + bias`), same weights, world of one (gloo).

Tolerances, on CPU: float32 output and input/weight/bias gradients within 1e-5 relative to the largest
magnitude (one GEMM summation order against another); bfloat16 within 2 ulp of the output's scale (the fused
path rounds the biased sum once, megatron's path the product, then the sum). Both with megatron's
weight-gradient fusion (`main_grad`, engine/models/wgrad.py) and without. The sharded path (TP=2, the backward's
all-reduce) is held against a TP=1 model by tests/parallel/model_parity_script.py (its models have QKV biases).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

from engine.models.bias_epilogue import BiasInGemmColumnParallelLinear
from engine.models.wgrad import install_wgrad_fusion


def _config(dtype: torch.dtype, fused_wgrad: bool) -> TransformerConfig:
    if fused_wgrad:
        install_wgrad_fusion()
    return TransformerConfig(
        num_layers=1,
        hidden_size=48,
        num_attention_heads=4,
        params_dtype=dtype,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=fused_wgrad,
    )


def _layer(cls, config, groups, weight, bias):
    layer = cls(
        48,
        80,
        config=config,
        init_method=torch.nn.init.zeros_,
        bias=True,
        gather_output=False,
        tp_group=groups.megatron_groups().tp,
    )
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


def _run(layer, x, grad_out, fused_wgrad: bool):
    """(output, input grad, weight grad, bias grad) of one forward/backward; the weight's gradient is summed
    into a float32 `main_grad` when `fused_wgrad` (as under megatron DDP)."""
    if fused_wgrad:
        layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
    x = x.clone().requires_grad_(True)
    out, out_bias = layer(x)
    assert out_bias is None
    out.backward(grad_out)
    weight_grad = layer.weight.main_grad if fused_wgrad else layer.weight.grad
    return out.detach(), x.grad, weight_grad.float(), layer.bias.grad.float()


@pytest.mark.parametrize("fused_wgrad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_in_gemm_equals_megatrons_linear(groups, dtype, fused_wgrad):
    torch.manual_seed(0)
    config = _config(dtype, fused_wgrad)
    weight, bias = torch.randn(80, 48).to(dtype) * 0.1, torch.randn(80).to(dtype)
    x, grad_out = torch.randn(7, 3, 48).to(dtype), torch.randn(7, 3, 80).to(dtype)
    ref = _run(_layer(ColumnParallelLinear, config, groups, weight, bias), x, grad_out, fused_wgrad)
    fused_layer = _layer(BiasInGemmColumnParallelLinear, config, groups, weight, bias)
    out, _ = fused_layer(x.clone().requires_grad_(True))
    assert type(out.grad_fn).__name__ == "_LinearBiasInGemmBackward"  # the fused path ran
    got = _run(fused_layer, x, grad_out, fused_wgrad)
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = b.float().abs().max()
        tol = 1e-5 if dtype == torch.float32 else 2 * 2**-8
        assert (a.float() - b.float()).abs().max() <= tol * scale, name


def test_without_grad_or_with_a_frozen_weight_the_bias_is_still_added(groups):
    torch.manual_seed(1)
    config = _config(torch.float32, False)
    weight, bias = torch.randn(80, 48), torch.randn(80)
    x = torch.randn(5, 2, 48)
    expected = x @ weight.t() + bias
    layer = _layer(BiasInGemmColumnParallelLinear, config, groups, weight, bias)
    with torch.no_grad():
        out, _ = layer(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    layer.weight.requires_grad_(False)  # megatron's frozen-weight path: input gradient only
    x = x.requires_grad_(True)
    out, _ = layer(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(5, 2, 48), rtol=1e-5, atol=1e-5)


def test_the_spec_builds_the_qkv_projection_with_the_fused_bias_unless_turned_off():
    from engine.models.spec import Fusions, layer_spec

    on = layer_spec(False).submodules.self_attention.submodules.linear_qkv
    off = layer_spec(False, Fusions(qkv_bias=False)).submodules.self_attention.submodules.linear_qkv
    assert on is BiasInGemmColumnParallelLinear and off is ColumnParallelLinear


def test_deferred_weight_gradients_take_megatrons_path(groups):
    """Where megatron's forward does more than the GEMM and its bias (here: weight gradients deferred into
    `grad_output_buffer`, even an empty one), the layer leaves the call to megatron."""
    config = _config(torch.float32, False)
    layer = _layer(BiasInGemmColumnParallelLinear, config, groups, torch.randn(80, 48), torch.randn(80))
    x = torch.randn(4, 2, 48, requires_grad=True)
    common = dict(input=x, weight=layer.weight, bias=layer.bias, gradient_accumulation_fusion=False)
    common.update(allreduce_dgrad=False, tp_group=layer.tp_group)
    deferred = layer._forward_impl(
        **common, sequence_parallel=False, grad_output_buffer=[], wgrad_deferral_limit=0
    )
    fused = layer._forward_impl(
        **common, sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None
    )
    assert type(deferred.grad_fn).__name__ == "LinearWithGradAccumulationAndAsyncCommunicationBackward"
    assert type(fused.grad_fn).__name__ == "_LinearBiasInGemmBackward"
    torch.testing.assert_close(deferred, fused, rtol=1e-5, atol=1e-5)
