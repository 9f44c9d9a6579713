"""Attention of a shared-prompt micro-batch (engine/roles/shared_prompts.py) split at each response's
prompt: no keys gathered behind a copy of the prompt's.

A micro-batch holds every unit's prompt (the prompts block), then every unit's responses in the same order
(the responses block), then any padding. A response token attends to its prompt's keys and to its own first
tokens, a softmax over the union of two key sets; each is one attention call over the whole micro-batch:
- self: every segment (prompts, responses, padding) over its own keys, causal (square segments, so a mask
  aligned to either corner is the right one);
- cross: each unit's responses, back to back in the responses block, over its prompt's keys, no mask.
A response token's two parts merge by their log-sum-exps: with l = logaddexp(l_self, l_cross) the softmax
over the union is each part's softmax weighted by exp(l_part - l), so the output is
exp(l_self - l) o_self + exp(l_cross - l) o_cross (float32, rounded once). The backward runs each part's own
backward with the merged output and log-sum-exp (engine/models/lse_kernels.py), which gives each part's share
of the union's gradient, as ring attention does; the two parts' gradients of a token add in their own
precision (the exact sum of two values, rounded once). The merge is one Triton kernel on CUDA
(engine/models/triton_lse_merge.py; compiled where it does not apply).

Two forms:
- `split_attention`: where every unit has one shape (`uniform`: G prompts of P, G x n responses of R; a
  fixed-length step) the parts are dense batches, cuDNN's attention on views (`CUDNN`): the prompts (G, P)
  and the responses (G x n, R) causal, each unit's n x R response queries over its P keys. cuDNN is faster
  than FlashAttention-2 on equal rows (engine/models/packed_attention.py; scripts/bench/README.md) but its
  causal mask in torch is aligned to the keys' start, which the gathered layout's responses (fewer queries
  than keys) cannot use.
- `varlen_split_attention`: any micro-batch whose every unit with responses has a prompt (`CrossSegments`):
  FlashAttention-2 varlen for both parts (`FLASH_VARLEN`); against the gathered keys it saves their copies
  (the forward's gather, the saved copies, the backward's float32 scatter-add) and costs passes over the
  queries and outputs (engine/models/shared_prompt_attention.py `SPLIT_VARLEN`: off until measured).
`split_available` checks a device's kernel once on a small case against the float32 reference kernels;
where it raises or strays the gathered layout's kernels run (engine/models/shared_prompt_attention.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.models import triton_lse_merge
from engine.models.compiled import ATTENTION, cuda_kernel
from engine.models.lse_kernels import (
    CUDNN,
    MATH,
    MATH_VARLEN,
    LseKernel,
    VarlenLseKernel,
    in_layout,
    wide,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CrossSegments:
    """The responses block's queries over their prompts' keys: tokens [prompt_tokens, prompt_tokens +
    response_tokens) of the micro-batch, unit by unit (`q_bounds`, relative to the block's start; units
    without responses left out), each over its prompt's keys (`k_bounds`, positions in the prompts block), on
    `device`. Host integers; the kernels' boundary tensors are made on first use (`cu_q`, `cu_k`), so a
    micro-batch that never splits costs no copy to the device."""

    prompt_tokens: int
    q_bounds: tuple[int, ...]
    k_bounds: tuple[int, ...]
    device: torch.device

    @property
    def response_tokens(self) -> int:
        return self.q_bounds[-1]

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in itertools.pairwise(self.q_bounds))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in itertools.pairwise(self.k_bounds))

    @property
    def keys(self) -> tuple[int, int]:
        """The prompts block's rows in some segment (a kernel leaves the others' gradients unwritten)."""
        return self.k_bounds[0], self.k_bounds[-1]

    @functools.cached_property
    def cu_q(self) -> torch.Tensor:
        return torch.tensor(self.q_bounds, dtype=torch.int32).to(self.device)

    @functools.cached_property
    def cu_k(self) -> torch.Tensor:
        return torch.tensor(self.k_bounds, dtype=torch.int32).to(self.device)


def merge_parts(o_self, l_self, o_cross, l_cross, out) -> None:
    """Write the union's output into `out` (o_self's dtype) and its log-sum-exp into `l_self` and `l_cross`
    from two parts' outputs (token-major (..., heads, dim) views) and log-sum-exps ((..., heads) views),
    computed in float32 (float64 for float64 parts) and rounded once (module docstring); `out` may be
    o_self. One fused kernel on CUDA (engine/models/compiled.py `ATTENTION`)."""
    merged = torch.logaddexp(l_self, l_cross)
    weight = (l_self - merged).exp().unsqueeze(-1)  # the self part's share of each token's softmax
    out.copy_(torch.lerp(wide(o_cross), wide(o_self), weight))
    l_self.copy_(merged)
    l_cross.copy_(merged)


HALF = (torch.float16, torch.bfloat16)


def _merge(device: torch.device, dtype: torch.dtype) -> Callable:
    """`merge_parts` for parts of `dtype`: for half precision where Triton runs, one Triton kernel
    (engine/models/triton_lse_merge.py) where it takes the views, else compiled with symbolic sizes (one compile
    for every micro-batch shape); eager for float32 and float64 parts (the check's reference kernels), whose
    speed does not matter."""
    if dtype not in HALF:
        return merge_parts
    compiled = cuda_kernel(merge_parts, device, ATTENTION, dynamic=True)

    def merge(*parts) -> None:
        (triton_lse_merge.merge_parts if triton_lse_merge.supported(*parts) else compiled)(*parts)

    return merge


def varlen_split_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    cross: CrossSegments,
    scale: float | None,
    kernel: VarlenLseKernel,
) -> torch.Tensor:
    """q (t, heads, dim), k/v (t, groups, dim) of a shared-prompt micro-batch whose segments are bounded by
    `cu_seqlens` (none longer than `max_seqlen`) -> (t, heads, dim) (module docstring)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = (unit_stride(x) for x in (q, k, v))
    return _VarlenSplit.apply(q, k, v, cu_seqlens, max_seqlen, cross, scale, kernel)


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x with a unit stride over its last dimension (both kernels' need; x itself where it has one)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class _VarlenSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, longest, cross, scale, kernel):
        tp, tr = cross.prompt_tokens, cross.response_tokens
        out, lse, state = kernel.forward(q, k, v, cu, cu, longest, longest, True, scale)  # lse (heads, t)
        cross_args = (cross.cu_q, cross.cu_k, cross.max_q, cross.max_k, False, scale)
        oc, lc, state_c = kernel.forward(q[tp : tp + tr], k[:tp], v[:tp], *cross_args)
        responses = out[tp : tp + tr]
        merge = _merge(q.device, q.dtype)
        merge(responses, lse[:, tp : tp + tr].T, oc, lc.T, responses)  # lse views (tokens, heads)
        ctx.save_for_backward(q, k, v, out, lse, lc, cu)
        ctx.args = (longest, cross, scale, kernel, state, state_c)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, lc, cu = ctx.saved_tensors
        longest, cross, scale, kernel, state, state_c = ctx.args
        tp, tr = cross.prompt_tokens, cross.response_tokens
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, state, cu, cu, longest, longest, True, scale)
        responses = slice(tp, tp + tr)
        dqc, dkc, dvc = kernel.backward(
            dout[responses],
            q[responses],
            k[:tp],
            v[:tp],
            out[responses],
            lc,
            state_c,
            *(cross.cu_q, cross.cu_k, cross.max_q, cross.max_k, False, scale),
        )
        dq[responses] += dqc  # the exact sum of two half-precision values, rounded once
        first, last = cross.keys  # prompts of units without responses: in no segment, their rows unwritten
        dk[first:last] += dkc[first:last]
        dv[first:last] += dvc[first:last]
        return dq, dk, dv, None, None, None, None, None


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
    q, k, v = (unit_stride(x) for x in (q, k, v))
    return _DenseSplit.apply(q, k, v, uniform, scale, kernel)


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


def _prompts(x: torch.Tensor, uniform) -> torch.Tensor:
    """A (t, heads, dim) tensor's prompts block as a (G, P, heads, dim) view."""
    g, _, p, _ = uniform
    return x[: g * p].unflatten(0, (g, p))


def _responses(x: torch.Tensor, uniform) -> torch.Tensor:
    """A (t, heads, dim) tensor's responses block as a (G, n, R, heads, dim) view."""
    g, n, p, r = uniform
    return x[g * p :].unflatten(0, (g, n, r))


class _DenseSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, uniform, scale, kernel):
        (qp, qs, qc), (kp, ks, _), (vp, vs, _) = (_views(x, uniform) for x in (q, k, v))
        op, lp, state_p = kernel.forward(qp, kp, vp, True, scale)
        os_, ls, state_s = kernel.forward(qs, ks, vs, True, scale)
        oc, lc, state_c = kernel.forward(qc, kp, vp, False, scale)
        out = q.new_empty(q.shape)  # (t, heads, dim)
        _prompts(out, uniform).copy_(op.transpose(1, 2))
        merge = _merge(q.device, q.dtype)
        merge(  # each part's log-sum-exp buffer then holds the union's, in that part's layout
            _by_token(os_, uniform, False),
            _by_token(_lse(ls), uniform, False),  # (G, n, R, heads)
            _by_token(oc, uniform, True),
            _by_token(_lse(lc), uniform, True),
            _responses(out, uniform),
        )
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
        # sums of two half-precision values: exact, rounded once
        torch.add(_by_token(dqs, uniform, False), _by_token(dqc, uniform, True), out=_responses(dq, uniform))
        for grad, own, prompt, cross in ((dk, dks, dkp, dkc), (dv, dvs, dvp, dvc)):
            torch.add(prompt.transpose(1, 2), cross.transpose(1, 2), out=_prompts(grad, uniform))
            _responses(grad, uniform).copy_(_by_token(own, uniform, False))
        return dq, dk, dv, None, None, None


_AVAILABLE: dict[tuple, bool] = {}


def split_available(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: LseKernel | VarlenLseKernel = CUDNN
) -> bool:
    """Once per kernel, device, dtype, (heads, groups, dim) and q/k/v strides: the split with `kernel` on a
    small case of the layout, its inputs laid out with q's, k's and v's strides, against the float32
    reference kernel, forward and backward; False (logged, and the gathered layout's kernels run) where the
    kernel raises or strays past half-precision rounding (largest error over 5% of the reference's scale)."""
    key = (kernel, q.device, q.dtype, q.shape[1:], k.shape[1:], q.stride(), k.stride(), v.stride())
    if key not in _AVAILABLE:
        try:  # the first call may come from a forward without gradients (old log-probs): the check takes them
            with torch.inference_mode(False), torch.enable_grad():
                _AVAILABLE[key] = _check(q, k, v, kernel)
        except Exception as err:  # an op this torch or device lacks: the gathered kernels remain
            log.warning(
                "shared-prompt split attention unavailable (%s: %s); gathered keys instead",
                type(err).__name__,
                err,
            )
            _AVAILABLE[key] = False
    return _AVAILABLE[key]


CHECK_UNIFORM = (3, 5, 17, 23)
"""The dense check's shape: 3 prompts of 17 tokens, 5 responses of 23 each. The check compiles the merge
(`_merge`) for every shape after it; torch.compile gives equal sizes one symbol and guards on that, so no size
here (nor 3 x 5, the rows) equals another or a model's heads, groups or head dim: a real micro-batch's
shape would break such a guard and compile again."""

CHECK_LENGTHS = ([5, 4], [[4, 3], [6]], 3)
"""The varlen check's micro-batch: prompts of 5 and 4 tokens, the first's responses of 4 and 3, the second's of
6, then 3 tokens of padding (9 prompt and 13 response tokens: sizes of the merge, apart from a model's, as
above)."""


def check_case(kernel) -> tuple[int, Callable]:
    """(tokens, attend(q, k, v, kernel)) of the check's micro-batch for `kernel`'s form."""
    if isinstance(kernel, LseKernel):
        g, n, p, r = CHECK_UNIFORM
        return g * (p + n * r), lambda q, k, v, kern: split_attention(q, k, v, CHECK_UNIFORM, None, kern)
    prompts, responses, pad = CHECK_LENGTHS
    segments = [*prompts, *(r for unit in responses for r in unit), pad]
    cu = torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32)
    totals = [sum(unit) for unit in responses]
    q_bounds = tuple(itertools.accumulate(totals, initial=0))
    k_bounds = tuple(itertools.accumulate(prompts, initial=0))

    def attend(q, k, v, kern):
        cross = CrossSegments(sum(prompts), q_bounds, k_bounds, q.device)
        return varlen_split_attention(q, k, v, cu.to(q.device), max(segments), cross, None, kern)

    return int(cu[-1]), attend


def _laid_out_like(x: torch.Tensor, t: int, gen: torch.Generator) -> Callable[[torch.dtype], torch.Tensor]:
    """Random values for a (t, *x.shape[1:]) input, as a leaf in a given dtype with x's strides where they lay
    rows out one after another (a view into a wider row, as megatron's fused QKV projection hands them out),
    else contiguous: the same values in each dtype."""
    shape = (t, *x.shape[1:])
    rows_apart = x.stride(0) >= x.shape[1] * x.stride(1) and x.stride(1) >= x.shape[2] * x.stride(2)
    strides = x.stride() if rows_apart and x.stride(2) == 1 else torch.empty(shape, device="meta").stride()
    values = torch.randn(t * strides[0], device=x.device, generator=gen)
    return lambda dtype: values.to(dtype).as_strided(shape, strides).requires_grad_()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel) -> bool:
    t, attend = check_case(kernel)
    reference = MATH if isinstance(kernel, LseKernel) else MATH_VARLEN
    gen = torch.Generator(device=q.device).manual_seed(0)
    inputs = [_laid_out_like(x, t, gen) for x in (q, k, v)]
    grad = torch.randn(t, *q.shape[1:], device=q.device, generator=gen)
    results = []
    for kern, dtype in ((kernel, q.dtype), (reference, torch.float32)):
        leaves = [make(dtype) for make in inputs]
        out = attend(*leaves, kern)
        grads = torch.autograd.grad(out, leaves, grad.to(dtype))
        results.append([out.float(), *(g.float() for g in grads)])
    ok = all((a - b).abs().max() <= 0.05 * b.abs().max() for a, b in zip(*results))
    if not ok:
        log.warning("shared-prompt split attention strays from its reference here; gathered keys instead")
    return bool(ok)
