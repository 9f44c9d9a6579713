"""Log-probs and entropy of target tokens straight from final hidden states: the output projection, the
vocab-parallel log-softmax and the entropy fused and chunked over rows, so no (tokens, vocab) logits tensor
ever lives beyond one chunk.

Why: with a 151,936-row vocabulary the logits dominate the actor's memory and much of its update time. The
unfused path materialises bf16 logits for every position of the sequence (prompt included), an fp32 copy
of the response window, then several fp32 passes each for the log-softmax, the entropy and their backward,
and keeps those tensors alive until the backward. Here only the (rows, hidden) hidden states are saved;
each chunk's logits are recomputed in the backward (one extra matmul of the output layer, on response
positions only), and the elementwise work of a chunk runs as two kernels on CUDA, each one pass over the
chunk's bf16 logits: the forward's statistics (max, sums, the target's logit) and the backward's gradient of
the logits (Triton, engine/models/triton_logprobs.py; torch.compile'd op chains where Triton does not run;
speed and memory against the unfused path: scripts/bench/logprobs.py, figures in scripts/bench/README.md).

Math, for one row with temperature t, z = (h @ W^T) / t over the full vocabulary (split across the TP
group; rows of W padded for TP get z = -1e30), m = max z, S = sum exp(z - m), A = sum exp(z - m)(z - m):
    log p(target) = z_target - m - log S,      entropy H = log S - A / S,
    dlogp/dz_j = [j = target] - p_j,           dH/dz_j = -p_j (log p_j + H).
Each TP rank computes m, S and A over its own vocabulary slice; the forward's two small all-reduces per chunk
(max; then S, A rescaled to the global max and the target logit: `_combine`) join them, the backward needs
none: the partial gradient of h (this rank's vocabulary slice) is summed by the TP mapping the
caller applies to h (engine/models/output_head.py), as megatron's ColumnParallelLinear does for its input.
The weight's gradient is summed over the chunks in float32 by the GEMMs themselves (engine/models/wgrad.py),
straight into megatron DDP's `main_grad` when the weight has one (then no bf16 gradient is returned at all).

One pass (`linear_log_probs_one_pass`, the actor's training path for token-local losses): when the loss's
gradient of each token's log-prob and entropy is known from that token's own values (PPO's clipped ratio, the
KL estimators, the entropy bonus: engine/step/losses.py `token_grads`), each chunk's gradient of the logits,
of h and of W is computed in the forward while the chunk's logits are still in memory; the backward only
hands them back. Three vocab x hidden GEMMs per token instead of four: at Qwen2.5-0.5B's update ~5% of its
FLOPs, the logits of every response token computed once instead of twice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.models import triton_logprobs
from engine.models.compiled import LOGPROBS, cuda_kernel, switched_on
from engine.models.logprobs import MASKED_LOGIT
from engine.models.wgrad import accumulate_matmul

# transient bytes of one chunk's logits and their gradient
CHUNK_BYTES = 2 << 30
# per logit: the Triton kernels read the low-precision logits and write their gradient (2 + 2 bytes); the
# compiled or eager op chains also hold float32 copies (logits and probabilities, 4 + 4) next to them
TRITON_BYTES_PER_LOGIT = 4
OP_CHAIN_BYTES_PER_LOGIT = 10


def chunk_rows(
    vocab_local: int, budget_bytes: int = CHUNK_BYTES, bytes_per_logit: int = OP_CHAIN_BYTES_PER_LOGIT
) -> int:
    """Rows per chunk so that a chunk's transient tensors (`bytes_per_logit` per logit) fit `budget_bytes`."""
    return max(64, budget_bytes // (vocab_local * bytes_per_logit))


def _default_chunk_rows(weight: torch.Tensor, hidden: torch.Tensor) -> int:
    """`chunk_rows` for the kernels that will run on this weight and these hidden rows: 2.5x more rows per
    chunk where both Triton kernels run (fewer, larger GEMMs and fewer per-chunk launches)."""
    triton = switched_on(LOGPROBS) and triton_logprobs.supported(hidden.device, hidden.dtype)
    per_logit = TRITON_BYTES_PER_LOGIT if triton else OP_CHAIN_BYTES_PER_LOGIT
    return chunk_rows(weight.shape[0], bytes_per_logit=per_logit)


def chunk_slices(n: int, rows_per_chunk: int) -> list[slice]:
    """Row slices of at most `rows_per_chunk` covering range(n), none of one row when n > 1 and
    rows_per_chunk > 2 (a remainder of one row is taken from the previous chunk): the compiled kernels treat
    the row count as symbolic, but torch.compile specialises a size of 1, so a one-row chunk would compile
    them again mid-run."""
    starts = list(range(0, n, rows_per_chunk))
    if rows_per_chunk > 2 and n > 1 and n - starts[-1] == 1:
        starts[-1] -= 1
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], n])]


def _masked(z: torch.Tensor, pad_from: int) -> torch.Tensor:
    """z with the TP-padding columns (>= pad_from) set to MASKED_LOGIT."""
    if pad_from >= z.shape[1]:
        return z
    col = torch.arange(z.shape[1], device=z.device)
    return torch.where(col < pad_from, z, MASKED_LOGIT)


def _local_stats(logits, local_t, in_shard, inv_t: float, pad_from: int) -> torch.Tensor:
    """(4, rows) float32 of this rank's vocabulary slice: the max m of the scaled logits z, S = sum exp(z - m),
    A = sum exp(z - m)(z - m), and the target's z (0 off this shard). The op chain: compiled on CUDA where
    the Triton kernel does not run (`_local_stats_fn`), eager on the CPU."""
    z = _masked(logits.float() * inv_t, pad_from)
    m = z.max(dim=-1).values
    d = z - m[:, None]
    e = d.exp()
    z_t = z.gather(1, local_t[:, None])[:, 0] * in_shard
    return torch.stack([m, e.sum(-1), (e * d).sum(-1), z_t])


def _local_stats_fn(device: torch.device, dtype: torch.dtype):
    """`_local_stats` as one pass over a chunk: the Triton kernel (engine/models/triton_logprobs.py) where it
    runs, else compiled on CUDA; eager with ENGINE_COMPILE_LOGPROBS=0 and on CPU."""
    if switched_on(LOGPROBS) and triton_logprobs.supported(device, dtype):
        return triton_logprobs.row_stats
    return _kernel(_local_stats, device)


def _combine(stats: torch.Tensor, in_shard: torch.Tensor, tp_group) -> tuple[torch.Tensor, ...]:
    """(m, S, A, z_target - m) over the whole vocabulary from each TP rank's `_local_stats`: m the largest
    local max, each rank's sums rescaled to it (exp(m_r - m) S_r; exp(m_r - m)(A_r + (m_r - m) S_r)) and
    summed, the target's logit from the rank that holds it. Two small all-reduces (max, then sums); without
    TP the local statistics themselves."""
    m_local, s, a, z_t = stats
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return m_local, s, a, (z_t - m_local) * in_shard
    m = m_local.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shift = m_local - m
    w = shift.exp()
    sums = torch.stack([w * s, w * (a + shift * s), (z_t - m) * in_shard])
    dist.all_reduce(sums, group=tp_group)
    return m, *sums


def _grad_logits(logits, shift, ent, g_logp, g_ent, local_t, in_shard, inv_t: float, pad_from: int):
    """dL/dlogits (in the low-precision dtype of `logits`) from the gradients of log p(target) and of the
    entropy, both already divided by the temperature: -p (g_logp + g_ent (log p + H)) + g_logp [j = target]."""
    logp = _masked(logits.float() * inv_t, pad_from) - shift[:, None]
    coef = g_logp[:, None] + g_ent[:, None] * (logp + ent[:, None])
    col = torch.arange(logits.shape[1], device=logits.device)
    onehot = (col == local_t[:, None]) & in_shard[:, None]
    return (torch.where(onehot, g_logp[:, None], 0.0) - logp.exp() * coef).to(logits.dtype)


def _kernel(fn, device: torch.device):
    """`fn` as one fused pass over the chunk's logits on CUDA (ENGINE_COMPILE_LOGPROBS=0: eager)."""
    return cuda_kernel(fn, device, LOGPROBS)


def _shard(weight, targets, vocab_size: int, tp_group):
    """This rank's view of the targets: (local column of each target (0 off this shard), in_shard, pad_from:
    the first local column that is TP padding)."""
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    v_local = weight.shape[0]
    start = tp_rank * v_local
    pad_from = max(0, min(v_local, vocab_size - start))  # local columns >= pad_from are TP padding
    local_t = targets - start
    in_shard = (local_t >= 0) & (local_t < v_local)
    return torch.where(in_shard, local_t, torch.zeros_like(local_t)), in_shard, pad_from


def _chunk_stats(logits, local_stats, local_t, in_shard, inv_t: float, pad_from: int, tp_group):
    """(shift = m + log S, log p(target), entropy) of one chunk's rows from its logits, over the whole
    vocabulary (the TP group's `_combine`)."""
    stats = local_stats(logits, local_t, in_shard, inv_t, pad_from)
    m, s, a, zt = _combine(stats, in_shard, tp_group)
    log_s = s.log()
    return m + log_s, zt - log_s, log_s - a / s


class _WeightGrad:
    """The output weight's gradient summed over a head's chunks: straight into megatron DDP's float32
    `main_grad` when the weight has one (its hook then adds only what other uses of the weight left in .grad,
    e.g. a tied embedding's lookup, and the head returns no bf16 gradient at all); else, over several chunks,
    summed in float32 and rounded once; else one chunk's product."""

    def __init__(self, weight: torch.Tensor, main_grad: torch.Tensor | None, needed: bool, chunks: int):
        self.weight, self.needed, self.into_main = weight, needed, needed and main_grad is not None
        self.sum = main_grad if self.into_main else None
        if needed and not self.into_main and chunks > 1:
            self.sum = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        self.grad = None

    def add(self, g: torch.Tensor, h: torch.Tensor) -> None:
        """Add the chunk's g^T @ h, g its (rows, vocab_local) gradient of the logits, h its hidden rows."""
        if self.sum is not None:
            accumulate_matmul(self.sum, g.t(), h)
        elif self.needed:
            self.grad = g.t() @ h

    def result(self) -> torch.Tensor | None:
        """What the head's backward returns for the weight (None when it went into `main_grad`)."""
        if self.sum is not None and not self.into_main:
            return self.sum.to(self.weight.dtype)
        return self.grad


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_size, tp_group, rows_per_chunk):
        local_t, in_shard, pad_from = _shard(weight, targets, vocab_size, tp_group)
        inv_t = 1.0 / temperature
        shift_all, logp_all, ent_all = (hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in "sle")
        local_stats = _local_stats_fn(hidden.device, hidden.dtype)
        for rows in chunk_slices(hidden.shape[0], rows_per_chunk):
            logits = hidden[rows] @ weight.t()
            shift_all[rows], logp_all[rows], ent_all[rows] = _chunk_stats(
                logits, local_stats, local_t[rows], in_shard[rows], inv_t, pad_from, tp_group
            )
            del logits
        ctx.save_for_backward(hidden, weight, local_t, in_shard, shift_all, ent_all)
        # megatron DDP's float32 gradient buffer of the weight, kept on ctx as its linear layers keep it
        ctx.main_grad = getattr(weight, "main_grad", None)
        ctx.inv_t, ctx.pad_from, ctx.rows_per_chunk = inv_t, pad_from, rows_per_chunk
        ctx.set_materialize_grads(False)
        return logp_all, ent_all

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, local_t, in_shard, shift, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp is None and grad_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        g_logp = grad_logp * ctx.inv_t if grad_logp is not None else torch.zeros_like(shift)
        g_ent = grad_ent * ctx.inv_t if grad_ent is not None else torch.zeros_like(shift)
        grad_logits = _grad_logits_fn(hidden.device, hidden.dtype)
        chunks = chunk_slices(hidden.shape[0], ctx.rows_per_chunk)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = _WeightGrad(weight, ctx.main_grad, need_w, len(chunks))
        for rows in chunks:
            g = grad_logits(
                hidden[rows] @ weight.t(),
                shift[rows],
                ent[rows],
                g_logp[rows],
                g_ent[rows],
                local_t[rows],
                in_shard[rows],
                ctx.inv_t,
                ctx.pad_from,
            )
            if need_h:
                grad_h[rows] = g @ weight
            grad_w.add(g, hidden[rows])
            del g
        return grad_h, grad_w.result(), None, None, None, None, None


TokenGrads = Callable[[slice, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""`(rows, logp, ent) -> (dL/dlogp, dL/dent)`, float32, for the head's rows `rows` (a slice of its flattened
tokens) given their log-probs and entropies: the gradient of a loss in which each token's term depends on
that token's own log-prob and entropy only (engine/step/losses.py `make_actor_loss`'s `token_grads`)."""


class _LinearLogProbsOnePass(torch.autograd.Function):
    """The head and the loss's gradient in one pass: each chunk's logits give its log-probs and entropies,
    then (from `token_grads`) the loss's gradient of each, then, from the same logits still in memory, the
    gradients of the hidden rows and of the weight. No logits are recomputed in the backward (the two-pass
    head's third vocab x hidden GEMM per token). The weight's gradient is summed in the forward (into
    `main_grad` when it has one); the backward hands back what the forward computed."""

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, temperature, vocab_size, tp_group, rows_per_chunk, token_grads, scale
    ):
        local_t, in_shard, pad_from = _shard(weight, targets, vocab_size, tp_group)
        inv_t = 1.0 / temperature
        logp_all, ent_all = (hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in "le")
        local_stats = _local_stats_fn(hidden.device, hidden.dtype)
        grad_logits = _grad_logits_fn(hidden.device, hidden.dtype)
        chunks = chunk_slices(hidden.shape[0], rows_per_chunk)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = _WeightGrad(weight, getattr(weight, "main_grad", None), need_w, len(chunks))
        scale_t = scale * inv_t  # the backward's loss scale, and dz/dlogits = 1 / temperature
        for rows in chunks:
            h = hidden[rows]
            logits = h @ weight.t()
            shift, logp, ent = _chunk_stats(
                logits, local_stats, local_t[rows], in_shard[rows], inv_t, pad_from, tp_group
            )
            logp_all[rows], ent_all[rows] = logp, ent
            if not (need_h or need_w):
                continue
            g_logp, g_ent = token_grads(rows, logp, ent)
            g = grad_logits(
                logits,
                shift,
                ent,
                g_logp * scale_t,
                g_ent * scale_t,
                local_t[rows],
                in_shard[rows],
                inv_t,
                pad_from,
            )
            del logits
            if need_h:
                grad_h[rows] = g @ weight
            grad_w.add(g, h)
            del g
        ctx.grad_h, ctx.grad_w = grad_h, grad_w.result()
        ctx.mark_non_differentiable(logp_all, ent_all)
        return hidden.new_zeros((), dtype=torch.float32), logp_all, ent_all

    @staticmethod
    def backward(ctx, grad_anchor, grad_logp, grad_ent):
        grad_h, grad_w = ctx.grad_h, ctx.grad_w
        ctx.grad_h = ctx.grad_w = None
        return grad_h, grad_w, None, None, None, None, None, None, None


def _grad_logits_fn(device: torch.device, dtype: torch.dtype):
    """`_grad_logits` as one pass over a chunk: the Triton kernel (engine/models/triton_logprobs.py) where it
    runs, else compiled on CUDA; eager with ENGINE_COMPILE_LOGPROBS=0 and on CPU."""
    if switched_on(LOGPROBS) and triton_logprobs.supported(device, dtype):
        return triton_logprobs.grad_logits
    return _kernel(_grad_logits, device)


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    rows_per_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy), each float32 of targets' shape, for hidden states (..., hidden) and this
    rank's vocab-parallel output weight (vocab_padded / tp, hidden); differentiable in hidden and weight.

    `hidden` must already be the TP-replicated input of the output layer (its gradient here is this rank's
    partial sum; the caller's TP mapping reduces it). Rows of the weight at ids >= vocab_size are TP
    padding and get no probability.
    """
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).long()
    if h.shape[0] != t.shape[0]:
        raise ValueError(f"linear_log_probs: {h.shape[0]} hidden rows but {t.shape[0]} targets")
    rows = rows_per_chunk or _default_chunk_rows(weight, h)
    logp, ent = _LinearLogProbs.apply(h, weight, t, float(temperature), vocab_size, tp_group, rows)
    return logp.view(lead), ent.view(lead)


def linear_log_probs_one_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_grads: TokenGrads,
    *,
    grad_scale: torch.Tensor | float = 1.0,
    temperature: float = 1.0,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    rows_per_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(anchor, log p(target), entropy) for flat hidden states (n, hidden) and targets (n,): `linear_log_probs`
    with the loss's gradient computed in the forward from `token_grads` (over the n rows in order). The
    log-probs and entropies carry no gradient; the float32 zero `anchor` carries the loss's: add it to the
    loss computed from them. Its backward returns the gradients of `grad_scale` x the loss, computed here,
    whatever gradient the anchor receives: the backward must bring `grad_scale` (megatron's schedule
    multiplies the loss by `config.grad_scale_func`'s scale, engine/roles/policy.py passes the same)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_log_probs_one_pass: hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}"
        )
    rows = rows_per_chunk or _default_chunk_rows(weight, hidden)
    return _LinearLogProbsOnePass.apply(
        hidden,
        weight,
        targets.long(),
        float(temperature),
        vocab_size,
        tp_group,
        rows,
        token_grads,
        grad_scale,
    )
