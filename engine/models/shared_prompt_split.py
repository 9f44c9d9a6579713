"""Attention of a shared-prompt micro-batch of one shape (engine/roles/shared_prompts.py `uniform_shape`) as
dense batches: cuDNN's attention on views, no gathered keys.

The micro-batch holds G prompts of P tokens (the prompts block), then G x n responses of R tokens (the
responses block). A response token attends to its prompt's P keys and to its own first tokens, a softmax over
the union of two key sets; each part is a dense batch of one shape:
- self: (G x n, R) queries over their own R keys, causal (a square: cuDNN's top-left mask is the right one);
- cross: each prompt's n x R response queries (its responses lie back to back) over its P keys, no mask;
- the prompts themselves: (G, P), causal.
The two parts of a response token merge by their log-sum-exps: with l = logaddexp(l_self, l_cross) the
softmax over the union is each part's softmax weighted by exp(l_part - l), so the output is
exp(l_self - l) o_self + exp(l_cross - l) o_cross (float32, rounded once). The backward runs each part's own
backward with the merged output and log-sum-exp (what a flash backward reads: P = exp(S - l), and
D = rowsum(dO x O)), which gives each part's share of the union's gradient, as ring attention does; query
gradients of the two parts add in float32.

Why: the gathered layout (engine/models/shared_prompt_attention.py) puts each response's keys after a copy
of its prompt's and needs a causal mask aligned to the keys' end, which FlashAttention-2 has and cuDNN's
attention in torch has not; cuDNN takes 0.60-0.65x FlashAttention-2's time on equal rows
(engine/models/packed_attention.py). Kernels (`LseKernel`): cuDNN through torch's aten ops on CUDA
(`CUDNN`), and a float32 reference of the same contract (`MATH`: the CPU tests of the split, and the check on
a device's first use, `split_available`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LseKernel:
    """Attention over (b, heads, s, dim) views with key/value groups dividing the heads, causal (s_q = s_k) or
    unmasked: `forward(q, k, v, causal, scale) -> (out, lse, state)`, out like q, lse (b, heads, s_q[, 1])
    float32 natural-log; `backward(dout, q, k, v, out, lse, state, causal, scale) -> (dq, dk, dv)` from any
    `out` and `lse` of those layouts (the merged ones)."""

    forward: Callable
    backward: Callable


def _math_forward(q, k, v, causal: bool, scale: float):
    scores, vv = _scores(q, k, causal, scale), _wide(_repeat(v, q.shape[1]))
    lse = scores.logsumexp(-1, keepdim=True)  # (b, heads, s_q, 1)
    return ((scores - lse).exp() @ vv).to(q.dtype), lse, None


def _math_backward(dout, q, k, v, out, lse, state, causal: bool, scale: float):
    groups = k.shape[1]
    kk, vv = _wide(_repeat(k, q.shape[1])), _wide(_repeat(v, q.shape[1]))
    p = (_scores(q, k, causal, scale) - lse.reshape(*lse.shape[:3], 1)).exp()  # the merged softmax's share
    do = _wide(dout)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vv.transpose(-1, -2) - (do * _wide(out)).sum(-1, keepdim=True))
    dq, dk = (ds @ kk) * scale, (ds.transpose(-1, -2) @ _wide(q)) * scale

    def per_group(x):  # (b, heads, s, dim) -> (b, groups, s, dim): each group's heads summed
        return x.unflatten(1, (groups, -1)).sum(2)

    return dq.to(q.dtype), per_group(dk).to(k.dtype), per_group(dv).to(v.dtype)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (_wide(q) @ _wide(_repeat(k, q.shape[1])).transpose(-1, -2)) * scale  # (b, heads, s_q, s_k)
    if causal:
        s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    return s


def _wide(x: torch.Tensor) -> torch.Tensor:
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
    dout = in_strides(dout, out)  # cuDNN reads the output's gradient in the output's layout
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0, causal, scale=scale
    )


CUDNN = LseKernel(_cudnn_forward, _cudnn_backward)


def in_strides(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`x` laid out with `like`'s strides (x itself where it already is)."""
    if x.stride() == like.stride():
        return x
    return torch.empty_strided(like.shape, like.stride(), dtype=x.dtype, device=x.device).copy_(x)


def split_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    uniform: tuple[int, int, int, int],
    scale: float | None,
    kernel: LseKernel = CUDNN,
) -> torch.Tensor:
    """q (t, heads, dim), k/v (t, groups, dim) of a shared-prompt micro-batch of shape `uniform` (G units, n
    responses each, prompt P, response R; t = G x (P + n x R)) -> (t, heads, dim) (module docstring)."""
    g, n, p, r = uniform
    if q.shape[0] != g * (p + n * r):
        raise ValueError(
            f"split_attention: {q.shape[0]} tokens, not the {g * (p + n * r)} of shape {uniform}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _SplitAttention.apply(q, k, v, uniform, scale, kernel)


def _views(x: torch.Tensor, uniform) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t, heads, dim) -> the prompts (G, heads, P, dim), the responses one by one (G x n, heads, R, dim) and
    per prompt (G, heads, n x R, dim): views."""
    g, n, p, r = uniform
    prompts, responses = x[: g * p], x[g * p :]
    return (
        prompts.unflatten(0, (g, p)).transpose(1, 2),
        responses.unflatten(0, (g * n, r)).transpose(1, 2),
        responses.unflatten(0, (g, n * r)).transpose(1, 2),
    )


def _by_token(x: torch.Tensor, uniform, per_prompt: bool) -> torch.Tensor:
    """A (G x n, heads, R[, dim]) self-part or (G, heads, n x R[, dim]) cross-part tensor as a
    (G, n, R, heads[, dim]) view: the responses' tokens in order."""
    g, n, _, r = uniform
    x = x.transpose(1, 2)
    return x.unflatten(1, (n, r)) if per_prompt else x.unflatten(0, (g, n))


def _lse(lse: torch.Tensor) -> torch.Tensor:
    """A kernel's (b, heads, s[, 1]) log-sum-exp as (b, heads, s): a view."""
    return lse[..., 0] if lse.dim() == 4 else lse


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, uniform, scale, kernel):
        (qp, qs, qc), (kp, ks, _), (vp, vs, _) = (_views(x, uniform) for x in (q, k, v))
        op, lp, state_p = kernel.forward(qp, kp, vp, True, scale)
        os_, ls, state_s = kernel.forward(qs, ks, vs, True, scale)
        oc, lc, state_c = kernel.forward(qc, kp, vp, False, scale)
        out = q.new_empty(q.shape)  # (t, heads, dim)
        _prompts(out, uniform).copy_(op.transpose(1, 2))
        ls_t, lc_t = (
            _by_token(_lse(ls), uniform, False),
            _by_token(_lse(lc), uniform, True),
        )  # (G, n, R, heads)
        merged = torch.logaddexp(ls_t, lc_t)
        weight = (ls_t - merged).exp().unsqueeze(-1)  # the self part's share of each token's softmax
        os_t, oc_t = _wide(_by_token(os_, uniform, False)), _wide(_by_token(oc, uniform, True))
        _responses(out, uniform).copy_(torch.lerp(oc_t, os_t, weight))
        ls_t.copy_(merged)  # each part's log-sum-exp buffer now holds the union's, in that part's layout
        lc_t.copy_(merged)
        ctx.save_for_backward(q, k, v, out, lp, ls, lc)
        ctx.uniform, ctx.scale, ctx.kernel = uniform, scale, kernel
        ctx.states = (state_p, state_s, state_c)
        ctx.layouts = tuple((o.shape, o.stride()) for o in (op, os_, oc))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lp, ls, lc = ctx.saved_tensors
        uniform, scale, kernel = ctx.uniform, ctx.scale, ctx.kernel
        (qp, qs, qc), (kp, ks, _), (vp, vs, _) = (_views(x, uniform) for x in (q, k, v))
        dop, dos, doc = _views(dout, uniform)
        outs = [in_layout(o, layout) for o, layout in zip(_views(out, uniform), ctx.layouts)]
        state_p, state_s, state_c = ctx.states
        dqp, dkp, dvp = kernel.backward(dop, qp, kp, vp, outs[0], lp, state_p, True, scale)
        dqs, dks, dvs = kernel.backward(dos, qs, ks, vs, outs[1], ls, state_s, True, scale)
        dqc, dkc, dvc = kernel.backward(doc, qc, kp, vp, outs[2], lc, state_c, False, scale)
        dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
        _prompts(dq, uniform).copy_(dqp.transpose(1, 2))
        _responses(dq, uniform).copy_(
            _wide(_by_token(dqs, uniform, False)) + _wide(_by_token(dqc, uniform, True))
        )
        for grad, own, prompt, cross in ((dk, dks, dkp, dkc), (dv, dvs, dvp, dvc)):
            _prompts(grad, uniform).copy_(_wide(prompt.transpose(1, 2)) + _wide(cross.transpose(1, 2)))
            _responses(grad, uniform).copy_(_by_token(own, uniform, False))
        return dq, dk, dv, None, None, None


def _prompts(x: torch.Tensor, uniform) -> torch.Tensor:
    """A (t, heads, dim) tensor's prompts block as a (G, P, heads, dim) view."""
    g, _, p, _ = uniform
    return x[: g * p].unflatten(0, (g, p))


def _responses(x: torch.Tensor, uniform) -> torch.Tensor:
    """A (t, heads, dim) tensor's responses block as a (G, n, R, heads, dim) view."""
    g, n, p, r = uniform
    return x[g * p :].unflatten(0, (g, n, r))


def in_layout(x: torch.Tensor, layout: tuple) -> torch.Tensor:
    """`x` with the (shape, strides) `layout` (x itself where it has them)."""
    shape, strides = layout
    if x.stride() == strides:
        return x
    return torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device).copy_(x)


_AVAILABLE: dict[tuple, bool] = {}


def split_available(q: torch.Tensor, k: torch.Tensor, kernel: LseKernel = CUDNN) -> bool:
    """Once per device, dtype and (heads, groups, dim): `split_attention` with `kernel` on a small case of
    the layout against `MATH` in float32, forward and backward; False (logged, and the gathered layout's
    kernels run) where the kernel raises or strays past bf16 rounding (largest error over 5% of the
    reference's scale)."""
    key = (q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2])
    if key not in _AVAILABLE:
        try:  # the first call may come from a forward without gradients (old log-probs): the check takes them
            with torch.inference_mode(False), torch.enable_grad():
                _AVAILABLE[key] = _check(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], kernel)
        except Exception as err:  # an op this torch or cuDNN lacks: the gathered kernels remain
            log.warning(
                "shared-prompt split attention unavailable (%s: %s); gathered keys instead",
                type(err).__name__,
                err,
            )
            _AVAILABLE[key] = False
    return _AVAILABLE[key]


def _check(device, dtype, heads: int, groups: int, dim: int, kernel: LseKernel) -> bool:
    uniform = (2, 3, 16, 24)
    t = 2 * (16 + 3 * 24)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (
        torch.randn(t, h, dim, device=device, generator=gen) for h in (heads, groups, groups, heads)
    )
    results = []
    for kern, cast in ((kernel, dtype), (MATH, torch.float32)):
        leaves = [x.to(cast).requires_grad_() for x in (q, k, v)]
        out = split_attention(*leaves, uniform, None, kern)
        results.append([out.float(), *(x.float() for x in torch.autograd.grad(out, leaves, grad.to(cast)))])
    ok = all((a - b).abs().max() <= 0.05 * b.abs().max() for a, b in zip(*results))
    if not ok:
        log.warning("shared-prompt split attention strays from its reference here; gathered keys instead")
    return bool(ok)
