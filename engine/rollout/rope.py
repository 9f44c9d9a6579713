"""Rotary position embeddings of the native rollout forward, as megatron computes and rounds them
(engine/rollout/model.py applies them; the Triton kernels of triton_rope_kv.py and triton_decode.py take the
same tables)."""

from __future__ import annotations

import math

import torch

from engine.models.builder import ModelShape


def _llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """megatron RotaryEmbedding._apply_scaling (low/high frequency factors 1/4, original context 8192)."""
    low_wavelen, high_wavelen, old_len = 8192 / 1.0, 8192 / 4.0, 8192
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - 1.0) / (4.0 - 1.0)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    shape: ModelShape, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (max_position_embeddings, head_dim) in `dtype`, rounded as megatron rounds them:
    frequencies in float32 on the compute device, cos/sin cast to the activation dtype."""
    hd = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    if shape.rope_scaling_factor > 0:
        inv_freq = _llama3_scaled(inv_freq, shape.rope_scaling_factor)
    seq = torch.arange(shape.max_position_embeddings, dtype=torch.float32, device=device)
    freqs = torch.outer(seq, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # (positions, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[-sin_1; sin_2] over the last dim (see `apply_rope`)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """megatron's x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x, dim / 2) * sin_signed
    (sin_signed = [-sin_1; sin_2]): the same products, bit for bit, in 4 ops instead of 6."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
