"""The update's kernels outside the layer spec's op chains, against the paths they replace.

engine/models/wgrad.py (weight gradients summed into `main_grad` by their GEMM) against the product computed
apart and added: on CPU `accumulate_matmul` and megatron's own linear layers running it through
`gradient_accumulation_fusion=True` (float32: exact up to summation order, 1e-6); on CUDA (marked `gpu`)
bfloat16 inputs into a float32 `main_grad` against the float64 product (within 1e-3 of the largest entry,
and closer than the product rounded to bfloat16 first). engine/models/triton_swiglu.py on CUDA against
megatron's compiled SwiGLU, and engine/models/triton_rope.py through megatron's fused-RoPE hooks against the
compiled RoPE, and engine/models/triton_rms_norm.py against a float32 autograd of the reference norm (their
CPU checks under Triton's interpreter: tests/engine/interpreted_triton.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.models.wgrad import accumulate_matmul, install_wgrad_fusion


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_matmul_adds_the_product(dtype):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=g), torch.randn(7, 3, generator=g)
    out = torch.randn(5, 3, generator=g)
    expected = out.double() + (a.to(dtype) @ b.to(dtype)).double()
    accumulate_matmul(out, a.to(dtype), b.to(dtype))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6)


def test_megatron_linear_layers_sum_weight_gradients_into_main_grad(groups):
    """ColumnParallelLinear and RowParallelLinear built with gradient_accumulation_fusion=True (refused by
    megatron without apex unless install_wgrad_fusion ran): the weight gradient lands in `main_grad`, on top
    of what was there, and none in .grad; the input gradient is unchanged."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    install_wgrad_fusion()
    config = ModelParallelConfig(use_cpu_initialization=True, gradient_accumulation_fusion=True)
    torch.manual_seed(0)
    kw = dict(config=config, init_method=torch.nn.init.normal_, bias=True, skip_bias_add=False)
    for layer in (
        ColumnParallelLinear(6, 10, gather_output=True, **kw),
        RowParallelLinear(6, 10, input_is_parallel=True, **kw),
    ):
        w = layer.weight
        w.main_grad = torch.full(w.shape, 0.5)
        x = torch.randn(4, 3, 6, requires_grad=True)  # (seq, batch, hidden)
        out, _ = layer(x)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        expected = 0.5 + grad_out.reshape(-1, 10).t() @ x.detach().reshape(-1, 6)
        torch.testing.assert_close(w.main_grad, expected, atol=1e-6, rtol=1e-6)
        assert w.grad is None
        torch.testing.assert_close(x.grad, grad_out @ w.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bfloat16_product_summed_into_float32_on_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(1536, 4096, device="cuda", generator=g).bfloat16()
    b = torch.randn(4096, 896, device="cuda", generator=g).bfloat16()
    out = torch.randn(1536, 896, device="cuda", generator=g)
    expected = out.double() + a.double() @ b.double()
    unfused = out + (a @ b).float()  # megatron's path without the fusion: a bfloat16 product, then added
    ptr = out.data_ptr()
    accumulate_matmul(out, a, b)
    assert out.dtype == torch.float32 and out.data_ptr() == ptr
    err = (out.double() - expected).abs().max()
    assert err / expected.abs().max() < 1e-3, err
    assert err < (unfused.double() - expected).abs().max()  # the product is not rounded to bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swiglu_kernels_match_megatrons_compiled_swiglu_on_gpu():
    """engine/models/triton_swiglu.py against the kernels it replaces (megatron's torch.compile'd SwiGLU and its
    backward) in bfloat16 at a Qwen2.5-1.5B MLP's width: both compute in float32 and round once, so they agree
    within one bfloat16 rounding (2**-7 relative)."""
    from megatron.core.fusions.fused_bias_swiglu import SwiGLUFunction

    from engine.models.triton_swiglu import swiglu

    g = torch.Generator(device="cuda").manual_seed(0)
    y = (torch.randn(3000, 2 * 8960, device="cuda", generator=g) * 2).bfloat16().requires_grad_()
    grad = torch.randn(3000, 8960, device="cuda", generator=g).bfloat16()
    out = swiglu(y)
    (dy,) = torch.autograd.grad(out, (y,), grad)
    ref = SwiGLUFunction.apply(y, False, False)
    (ref_dy,) = torch.autograd.grad(ref, (y,), grad)
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(dy, ref_dy, rtol=2**-7, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rope_kernel_matches_the_compiled_rope_on_gpu():
    """engine/models/triton_rope.py through megatron's hooks (`fused_rope`, `fused_rope_thd`) against the
    compiled `rope_reference` (float32 math, one rounding) in bf16 at Qwen2.5-1.5B's query shape (12 heads of
    128; megatron's angles cat(f, f)): forward and gradient within one bf16 rounding; packed rows by position
    equal the sbhd kernel on the gathered angles bitwise."""
    from engine.models import triton_rope
    from engine.models.spec import compiled_rope, fused_rope, fused_rope_thd, packed_positions

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    s, b, heads, dim = 1000, 2, 12, 128
    inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device=dev).float() / dim))
    f = torch.arange(4096, device=dev).float()[:, None] * inv[None]
    freqs = torch.cat((f, f), -1)[:, None, None]  # (4096, 1, 1, 128) as megatron's RotaryEmbedding
    t = torch.randn(s, b, heads, dim, generator=g, device=dev).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(s, b, heads, dim, generator=g, device=dev).to(torch.bfloat16)
    assert triton_rope.supported(t, freqs)
    out = fused_rope(t, freqs[:s])
    (dt,) = torch.autograd.grad(out, (t,), grad)
    ref = compiled_rope(torch.bfloat16, True)(t, freqs[:s])
    (ref_dt,) = torch.autograd.grad(ref, (t,), grad)
    for a, r in ((out, ref), (dt, ref_dt)):
        assert float((a.float() - r.float()).abs().max()) <= 2**-7 * float(r.float().abs().max())
    cu = torch.tensor([0, 700, 1500, 2000], device=dev, dtype=torch.int32)
    packed = t.detach().reshape(2000, heads, dim)
    positions = packed_positions(cu, 2000)
    assert torch.equal(fused_rope_thd(packed, cu, freqs), fused_rope(packed[:, None], freqs[positions])[:, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_kernels_are_as_close_to_float32_as_torchs_path_on_gpu():
    """engine/models/triton_rms_norm.py in bfloat16 at Qwen2.5-1.5B's width, 4,099 rows (many per backward
    program): y, dx and the weight's gradient within 1.5x the distance of torch's path (`F.rms_norm`, then the
    weight, through autograd) to a float32 autograd of the reference chain; and megatron-built RMSNorm modules
    run the kernels (the layer spec's default)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from norm_check import assert_no_further_than_torch

    from engine.models import triton_rms_norm
    from engine.models.spec import RMSNorm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(4099, 1, 1536, device="cuda", generator=g) * 3).bfloat16()
    w = (1 + 0.2 * torch.randn(1536, device="cuda", generator=g)).bfloat16()
    grad = torch.randn(4099, 1, 1536, device="cuda", generator=g).bfloat16()
    fused = functools.partial(triton_rms_norm.rms_norm, eps=1e-6)
    assert_no_further_than_torch(x, w, grad, fused, slack_max=1e-6, slack_mean=1e-7)
    config = TransformerConfig(
        num_layers=1, hidden_size=1536, num_attention_heads=12, params_dtype=torch.bfloat16
    )
    norm = RMSNorm(config, 1536).cuda()
    norm.weight.data.copy_(w)
    assert torch.equal(norm(x), triton_rms_norm.rms_norm(x, w, norm.eps))
