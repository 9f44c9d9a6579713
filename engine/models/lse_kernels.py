"""Attention kernels that return the softmax's log-sum-exp and take a given output and log-sum-exp in their
backward: what merging attention over two key sets needs (engine/models/shared_prompt_split.py).

Dense kernels (`LseKernel`) take (b, heads, s, dim) views; varlen ones (`VarlenLseKernel`) take packed
(t, heads, dim) tensors with segment boundaries (`cu_q`, `cu_k`). Each runs causal attention (square
segments: the mask's alignment does not matter) or unmasked attention, key/value groups dividing the heads.
- `CUDNN`: cuDNN's attention through torch's aten ops (`_scaled_dot_product_cudnn_attention` and its
  backward), CUDA, half precision; its output takes q's strides;
- `FLASH_VARLEN`: FlashAttention-2 varlen through torch's aten ops, as engine/models/packed_attention.py
  `FlashVarlen` calls it; its log-sum-exp (heads, t);
- `MATH`, `MATH_VARLEN`: the same contracts in float32 (float64 for float64 inputs), segment by segment: the
  CPU tests' reference and the check of a device's kernels on first use.
A backward given the merged output O and log-sum-exp l of attention over a union of key sets returns this key
set's share of the union's gradient: a flash backward reads only P = exp(S - l) and D = rowsum(dO x O).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LseKernel:
    """Attention over (b, heads, s, dim) views with key/value groups dividing the heads, causal (s_q = s_k) or
    unmasked: `forward(q, k, v, causal, scale) -> (out, lse, state)`, out like q, lse (b, heads, s_q[, 1])
    float32 natural-log; `backward(dout, q, k, v, out, lse, state, causal, scale) -> (dq, dk, dv)` from any
    `out` and `lse` of those layouts (the merged ones)."""

    forward: Callable
    backward: Callable


def _math_forward(q, k, v, causal: bool, scale: float):
    scores, vv = _scores(q, k, causal, scale), wide(_repeat(v, q.shape[1]))
    lse = scores.logsumexp(-1, keepdim=True)  # (b, heads, s_q, 1)
    return ((scores - lse).exp() @ vv).to(q.dtype), lse, None


def _math_backward(dout, q, k, v, out, lse, state, causal: bool, scale: float):
    groups = k.shape[1]
    kk, vv = wide(_repeat(k, q.shape[1])), wide(_repeat(v, q.shape[1]))
    p = (_scores(q, k, causal, scale) - lse.reshape(*lse.shape[:3], 1)).exp()  # the merged softmax's share
    do = wide(dout)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vv.transpose(-1, -2) - (do * wide(out)).sum(-1, keepdim=True))
    dq, dk = (ds @ kk) * scale, (ds.transpose(-1, -2) @ wide(q)) * scale

    def per_group(x):  # (b, heads, s, dim) -> (b, groups, s, dim): each group's heads summed
        return x.unflatten(1, (groups, -1)).sum(2)

    return dq.to(q.dtype), per_group(dk).to(k.dtype), per_group(dv).to(v.dtype)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (wide(q) @ wide(_repeat(k, q.shape[1])).transpose(-1, -2)) * scale  # (b, heads, s_q, s_k)
    if causal:
        s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    return s


def wide(x: torch.Tensor) -> torch.Tensor:
    """float32, or float64 where x is."""
    return x if x.dtype == torch.float64 else x.float()


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


MATH = LseKernel(_math_forward, _math_backward)


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return out, lse, (cu_q, cu_k, max_q, max_k, seed, offset)


def _cudnn_backward(dout, q, k, v, out, lse, state, causal: bool, scale: float):
    cu_q, cu_k, max_q, max_k, seed, offset = state
    dout = in_layout(
        dout, (out.shape, out.stride())
    )  # cuDNN reads the output's gradient in the output's layout
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0, causal, scale=scale
    )


CUDNN = LseKernel(_cudnn_forward, _cudnn_backward)


def in_layout(x: torch.Tensor, layout: tuple) -> torch.Tensor:
    """`x` with the (shape, strides) `layout` (x itself where it has them)."""
    shape, strides = layout
    if x.stride() == strides:
        return x
    return torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device).copy_(x)


@dataclass(frozen=True)
class VarlenLseKernel:
    """Attention within segments of packed q (t_q, heads, dim) and k/v (t_k, groups, dim), segment i the
    queries cu_q[i]:cu_q[i+1] over the keys cu_k[i]:cu_k[i+1] (none empty), causal (square segments) or
    unmasked: `forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale) -> (out, lse, state)`, out
    (t_q, heads, dim), lse (heads, t_q) float32; `backward(dout, q, k, v, out, lse, state, cu_q, cu_k, max_q,
    max_k, causal, scale) -> (dq, dk, dv)`; gradient rows of keys (or queries) in no segment are undefined
    (FlashAttention-2 leaves them unwritten; `MATH_VARLEN` makes them NaN)."""

    forward: Callable
    backward: Callable


def _flash_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    if lse.shape != (q.shape[1], q.shape[0]):  # a FlashAttention-2 whose varlen log-sum-exp is padded
        raise RuntimeError(f"FlashAttention-2 varlen log-sum-exp of shape {tuple(lse.shape)}, not (heads, t)")
    return out, lse, (rng_state, unused)


def _flash_backward(dout, q, k, v, out, lse, state, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale):
    rng_state, unused = state
    return torch.ops.aten._flash_attention_backward(
        dout.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        causal,
        rng_state,
        unused,
        scale=scale,
    )


FLASH_VARLEN = VarlenLseKernel(_flash_forward, _flash_backward)


def _segments(cu_q, cu_k):
    return zip(cu_q.tolist()[:-1], cu_q.tolist()[1:], cu_k.tolist()[:-1], cu_k.tolist()[1:])


def _dense(x: torch.Tensor) -> torch.Tensor:
    """A segment (s, heads, dim) as a (1, heads, s, dim) view."""
    return x.transpose(0, 1)[None]


def _math_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=wide)
    for q0, q1, k0, k1 in _segments(cu_q, cu_k):
        o, lse_b, _ = _math_forward(*(_dense(x) for x in (q[q0:q1], k[k0:k1], v[k0:k1])), causal, scale)
        out[q0:q1], lse[:, q0:q1] = o[0].transpose(0, 1), lse_b[0, :, :, 0]
    return out, lse, None


def _math_varlen_backward(dout, q, k, v, out, lse, state, cu_q, cu_k, max_q, max_k, causal: bool, scale):
    # rows in no segment NaN: FlashAttention-2 leaves them unwritten, and a caller must not read them
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    for x, cu in ((dq, cu_q), (dk, cu_k), (dv, cu_k)):
        for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]):
            x[a:b] = 0
    for q0, q1, k0, k1 in _segments(cu_q, cu_k):
        grads = _math_backward(
            _dense(dout[q0:q1]),
            *(_dense(x) for x in (q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1])),
            lse[None, :, q0:q1],
            None,
            causal,
            scale,
        )
        for total, grad, a, b in zip((dq, dk, dv), grads, (q0, k0, k0), (q1, k1, k1)):
            total[a:b] += grad[0].transpose(0, 1)
    return dq, dk, dv


MATH_VARLEN = VarlenLseKernel(_math_varlen_forward, _math_varlen_backward)
