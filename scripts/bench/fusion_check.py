"""The update bench's check of the layer spec's fused kernels (engine/models/spec.py `Fusions`: RMSNorm,
RoPE) against their reference chains on the device at a preset's sizes, output and input gradient, each beside
a float64 reference (`update.py` without `--no-check`)."""

from __future__ import annotations

import torch

from engine.models import triton_rope
from engine.models.builder import ModelShape
from engine.models.spec import RMSNorm, fused_rope, rope_reference


def _compare(fused: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> dict:
    diff = (fused.double() - ref.double()).abs()
    return {
        "max_abs_diff": diff.max().item(),
        "frac_elements_differ": (diff > 0).double().mean().item(),
        "max_abs_err_vs_fp64": {
            "fused": (fused.double() - exact).abs().max().item(),
            "reference": (ref.double() - exact).abs().max().item(),
        },
    }


def fusion_check(shape: ModelShape, device: torch.device, tokens: int = 1024) -> dict:
    """Fused kernels vs their reference chains on this device, output and input gradient, in the model dtype."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    gen = torch.Generator(device=device).manual_seed(1)
    dtype, out = shape.dtype, {}
    x = (torch.randn(tokens, 2, shape.hidden_size, device=device, generator=gen) * 3).to(dtype)
    g = torch.randn(x.shape, device=device, generator=gen).to(dtype)
    config = SimpleNamespace(params_dtype=dtype, sequence_parallel=False)
    weight = (torch.rand(shape.hidden_size, device=device, generator=gen) + 0.5).to(dtype)
    norms = [RMSNorm(config, shape.hidden_size, shape.norm_eps, fused=f).to(device) for f in (True, False)]
    results = []
    for norm in norms:
        norm.weight.data.copy_(weight)
        xi = x.detach().requires_grad_()
        y = norm(xi)
        results.append((y, torch.autograd.grad(y, xi, g)[0]))
    x64 = x.double().requires_grad_()
    y64 = weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + shape.norm_eps)
    (g64,) = torch.autograd.grad(y64, x64, g.double())
    out["rms_norm"] = {
        "output": _compare(results[0][0], results[1][0], y64),
        "grad": _compare(results[0][1], results[1][1], g64),
    }
    rope = RotaryEmbedding(kv_channels=shape.head_dim, rotary_percent=1.0, rotary_base=int(shape.rope_theta))
    freqs = rope(tokens).to(device)  # (s, 1, 1, head_dim) float32, as the model gets it
    t = torch.randn(tokens, 2, shape.num_attention_heads, shape.head_dim, device=device, generator=gen).to(
        dtype
    )
    g = torch.randn(t.shape, device=device, generator=gen).to(dtype)
    results = []
    for fn in (fused_rope, rope_reference):
        ti = t.detach().requires_grad_()
        y = fn(ti, freqs)
        results.append((y, torch.autograd.grad(y, ti, g)[0]))
    t64 = t.double().requires_grad_()
    y64 = rope_reference(t64, freqs.double())
    (g64,) = torch.autograd.grad(y64, t64, g.double())
    out["rope"] = {
        "output": _compare(results[0][0], results[1][0], y64),
        "grad": _compare(results[0][1], results[1][1], g64),
    }
    cuda_path = "triton" if triton_rope.supported(t, freqs) else "compiled"
    out["rope"]["path"] = cuda_path if device.type == "cuda" else "eager"
    return out
