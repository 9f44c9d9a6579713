"""Policy and value losses, their aggregation over tokens, and entropy from logits.

Split invariance, the rule every loss here follows: a loss on a shard (a DP rank's micro-batch) is
`masked sum / global_normalizer`, where the caller passes the normaliser of the WHOLE mini-batch (all DP
ranks, all micro-batches). Summing the shard losses then gives the full-batch loss exactly, however the
sequences are split (sequences are never split: shards cut along the batch dim). `loss_normalizer`
computes it from a mask; it is additive, so the global value is the sum of the shards' values (an
all-reduce SUM over DP of each rank's value over its whole mini-batch). If the DP gradient reduction
averages rather than sums, the caller scales the loss by the DP size.

Aggregation modes (l = loss per token, L_i = valid tokens of sequence i, N = sequences with >= 1 valid token):
    token-mean               sum_i sum_t l / sum_i L_i                (DAPO; verl default)
    seq-mean-token-sum       sum_i sum_t l / N
    seq-mean-token-mean      sum_i (sum_t l / L_i) / N                (original GRPO, GSPO)
    seq-mean-token-sum-norm  sum_i sum_t l / (N * max_len)            (Dr.GRPO; max_len a constant, e.g.
                                                                       the rollout's max new tokens)
The last is the Dr.GRPO paper's and TRL's `dr_grpo` normaliser. verl's differs: sum_i sum_t l / max_len
per micro-batch, then divided by the micro-batches per mini-batch, i.e. ours times its micro-batch size.
Metrics are detached 0-dim tensors averaged over this shard's valid tokens (for logging only).
Nothing here knows about configs or torch.distributed.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from algorithms._common import Registry, check_like_mask, check_mask, masked_mean, masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
_POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "policy_loss")


def _masked(x_bt: Tensor, name: str, mask_bt: Tensor) -> Tensor:
    """`x_bt` checked against the mask's shape (ValueError naming `name`), zero on padding."""
    x_bt = check_like_mask(x_bt, name, mask_bt)
    return torch.where(mask_bt, x_bt, torch.zeros((), dtype=x_bt.dtype, device=x_bt.device))


@dataclass(frozen=True)
class PolicyLossTraits:
    """Which `algorithm.*` settings a policy loss reads; the engine asks these instead of branching on names."""

    dual_clip: bool = True
    """Takes `clip_ratio_c` (the dual clip of negative advantages)."""
    sequence_ratio: bool = False
    """Clips a per-sequence importance ratio instead of per-token ratios."""
    token_local: bool = False
    """Each token's loss depends on that token's own inputs only (its log-prob, old and rollout log-probs,
    advantage), so its gradient is known as soon as its log-prob is: the engine's output head then computes
    the loss's gradient in its forward, from logits it has not yet freed (engine/models/fused_logprobs.py
    `linear_log_probs_one_pass`). Off unless a loss says so: a loss with any statistic over several tokens
    (a sequence ratio, a batch mean) must leave it off."""


_POLICY_LOSS_TRAITS: dict[str, PolicyLossTraits] = {}


def register_policy_loss(
    name: str, traits: PolicyLossTraits = PolicyLossTraits()
) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a policy loss with the common signature (see `ppo_policy_loss`) under `name`, with
    the `traits` the engine asks (`policy_loss_traits`)."""
    register = _POLICY_LOSSES.register(name)

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        fn = register(fn)
        _POLICY_LOSS_TRAITS[name] = traits
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name`; ValueError listing the known names otherwise."""
    return _POLICY_LOSSES.get(name)


def policy_loss_traits(name: str) -> PolicyLossTraits:
    """The traits the policy loss `name` was registered with; ValueError listing the known names otherwise."""
    _POLICY_LOSSES.get(name)
    return _POLICY_LOSS_TRAITS[name]


def policy_loss_names() -> list[str]:
    return _POLICY_LOSSES.names()


# ---------------------------------------------------------------------------------------------------------
# aggregation


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"loss_agg_mode={loss_agg_mode!r} is not a known aggregation mode; "
            f"known names: {', '.join(LOSS_AGG_MODES)}"
        )


def loss_normalizer(mask_bt: Tensor, loss_agg_mode: str, max_len: int | None = None) -> float:
    """Denominator of `agg_loss` for this mask: valid tokens (token-mean), sequences with a valid token
    (seq-mean-*), times `max_len` for seq-mean-token-sum-norm (required there). Additive over shards."""
    mask_bt = check_mask(mask_bt)
    _check_mode(loss_agg_mode)
    if loss_agg_mode == "token-mean":
        return float(mask_bt.sum())
    num_seqs = float(mask_bt.any(-1).sum())  # all-padding rows (e.g. DP balancing) do not count
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if max_len is None or max_len <= 0:
            raise ValueError(
                f"max_len={max_len!r}: seq-mean-token-sum-norm divides by a constant max length; pass a "
                "positive int that does not change between steps, e.g. the rollout's max new tokens"
            )
        return num_seqs * max_len
    return num_seqs


def agg_loss(
    loss_mat_bt: Tensor, mask_bt: Tensor, loss_agg_mode: str, global_normalizer: float | Tensor
) -> Tensor:
    """Aggregate a (batch, resp_len) per-token loss into a scalar: this shard's part of the global loss."""
    mask_bt = check_mask(mask_bt)
    check_like_mask(loss_mat_bt, "loss_mat_bt", mask_bt)
    _check_mode(loss_agg_mode)
    if not isinstance(global_normalizer, Tensor) and not global_normalizer > 0:
        raise ValueError(
            f"global_normalizer={global_normalizer!r} must be > 0; compute it with loss_normalizer() on the "
            "whole mini-batch's mask (summed over DP ranks), not on one shard"
        )
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sum_b = masked_sum(loss_mat_bt, mask_bt, dim=-1)  # (batch,)
        total = (seq_sum_b / mask_bt.sum(-1).clamp(min=1)).sum()  # all-padding rows add 0
    else:
        total = masked_sum(loss_mat_bt, mask_bt)
    return total / global_normalizer


# ---------------------------------------------------------------------------------------------------------
# policy losses


def _prepare(
    log_probs_bt: Tensor,
    old_log_probs_bt: Tensor,
    advantages_bt: Tensor,
    mask_bt: Tensor,
    rollout_log_probs_bt: Tensor | None,
    tis_cap: float,
    tis_mode: str = "truncate",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Check shapes, zero the padding (so garbage there cannot reach values or gradients), importance weights
    between the rollout and the old policy: truncated (min(w, cap)) or masked (w where w <= cap, else 0)."""
    mask_bt = check_mask(mask_bt)
    log_probs_bt = _masked(log_probs_bt, "log_probs_bt", mask_bt)
    old_bt = _masked(old_log_probs_bt, "old_log_probs_bt", mask_bt)
    advantages_bt = _masked(advantages_bt, "advantages_bt", mask_bt)
    if tis_cap < 0:
        raise ValueError(f"tis_cap={tis_cap!r} must be >= 0 (0 turns truncated importance sampling off)")
    tis_weights_bt = None
    if tis_cap > 0:
        if rollout_log_probs_bt is None:
            raise ValueError(f"rollout_log_probs_bt is required when tis_cap={tis_cap!r} > 0")
        if tis_mode not in TIS_MODES:
            raise ValueError(f"tis_mode={tis_mode!r} is not one of {TIS_MODES}")
        rollout_bt = _masked(rollout_log_probs_bt, "rollout_log_probs_bt", mask_bt)
        # min(exp(x), cap) == exp(min(x, log cap)), which cannot overflow
        raw_bt = (old_bt - rollout_bt).detach()
        log_w_bt = raw_bt.clamp(max=math.log(tis_cap))
        keep_bt = mask_bt if tis_mode == "truncate" else mask_bt & (raw_bt <= math.log(tis_cap))
        tis_weights_bt = torch.where(keep_bt, log_w_bt.exp(), 0.0)
    return mask_bt, log_probs_bt, old_bt, advantages_bt, tis_weights_bt


TIS_MODES = ("truncate", "mask")
"""Importance correction between rollout and old policy (tis_cap > 0): `truncate` weights each token loss by
min(w, cap) (TIS), `mask` by w where w <= cap and drops the tokens above the cap (masked IS)."""


def _check_clip(clip_ratio_low: float, clip_ratio_high: float) -> None:
    for arg_name, value in (("clip_ratio_low", clip_ratio_low), ("clip_ratio_high", clip_ratio_high)):
        if not 0 <= value:
            raise ValueError(f"{arg_name}={value!r} must be >= 0")
    if clip_ratio_low >= 1:
        raise ValueError(f"clip_ratio_low={clip_ratio_low!r} must be < 1 (the ratio is clipped at 1 - low)")


def _finish(
    pg_losses_bt: Tensor,
    metrics: dict[str, Tensor],
    mask_bt: Tensor,
    tis_weights_bt: Tensor | None,
    loss_agg_mode: str,
    global_normalizer: float | Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    if tis_weights_bt is not None:
        pg_losses_bt = pg_losses_bt * tis_weights_bt
        metrics["tis_weight_mean"] = masked_mean(tis_weights_bt, mask_bt)
    loss = agg_loss(pg_losses_bt, mask_bt, loss_agg_mode, global_normalizer)
    return loss, {k: v.detach() for k, v in metrics.items()}


@register_policy_loss("ppo", PolicyLossTraits(token_local=True))
def ppo_policy_loss(
    log_probs_bt: Tensor,
    old_log_probs_bt: Tensor,
    advantages_bt: Tensor,
    mask_bt: Tensor,
    *,
    loss_agg_mode: str,
    global_normalizer: float | Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_log_probs_bt: Tensor | None = None,
    tis_cap: float = 0.0,
    tis_mode: str = "truncate",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip (Schulman et al. 2017) with decoupled ranges (DAPO clip-higher) and dual clip (Ye et al. 2020).

    Per token: max(-A r, -A clip(r, 1 - low, 1 + high)); for A < 0 that is further capped at -A * clip_ratio_c.
    With tis_cap > 0 each token loss is multiplied by the detached weight min(exp(old - rollout), tis_cap)
    (tis_mode="mask": exp(old - rollout), and 0 where that exceeds tis_cap).
    Metrics: clipfrac, clipfrac_lower (dual clip active), approx_kl (mean old - new log-prob).
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    if not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c={clip_ratio_c!r} must be > 1 (dual-clip lower bound on -A * ratio)")
    mask_bt, log_probs_bt, old_bt, advantages_bt, tis_weights_bt = _prepare(
        log_probs_bt, old_log_probs_bt, advantages_bt, mask_bt, rollout_log_probs_bt, tis_cap, tis_mode
    )
    log_ratio_bt = (log_probs_bt - old_bt).clamp(-20.0, 20.0)  # keeps exp finite, as verl
    ratio_bt = log_ratio_bt.exp()
    unclipped_bt = -advantages_bt * ratio_bt
    clipped_bt = -advantages_bt * ratio_bt.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    pessimistic_bt = torch.maximum(unclipped_bt, clipped_bt)
    dual_bt = torch.minimum(pessimistic_bt, -advantages_bt * clip_ratio_c)
    pg_losses_bt = torch.where(advantages_bt < 0, dual_bt, pessimistic_bt)
    metrics = {
        "clipfrac": masked_mean((clipped_bt > unclipped_bt).to(ratio_bt.dtype), mask_bt),
        "clipfrac_lower": masked_mean(
            ((pessimistic_bt > dual_bt) & (advantages_bt < 0)).to(ratio_bt.dtype), mask_bt
        ),
        "approx_kl": masked_mean(-log_ratio_bt, mask_bt),
    }
    return _finish(pg_losses_bt, metrics, mask_bt, tis_weights_bt, loss_agg_mode, global_normalizer)


@register_policy_loss("gspo", PolicyLossTraits(dual_clip=False, sequence_ratio=True))
def gspo_policy_loss(
    log_probs_bt: Tensor,
    old_log_probs_bt: Tensor,
    advantages_bt: Tensor,
    mask_bt: Tensor,
    *,
    loss_agg_mode: str,
    global_normalizer: float | Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float = 3.0,
    rollout_log_probs_bt: Tensor | None = None,
    tis_cap: float = 0.0,
    tis_mode: str = "truncate",
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token (Zheng et al. 2025): clip the sequence ratio s_i = exp(mean_t(log pi - log pi_old)).

    Token ratio s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: its value is s_i and its gradient is s_i times the
    token's log-prob gradient, so with seq-mean-token-mean (the paper's objective) the gradient equals the
    sequence-level GSPO gradient. clip_ratio_c is accepted for a common signature and unused (no dual clip).
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    mask_bt, log_probs_bt, old_bt, advantages_bt, tis_weights_bt = _prepare(
        log_probs_bt, old_log_probs_bt, advantages_bt, mask_bt, rollout_log_probs_bt, tis_cap, tis_mode
    )
    log_ratio_bt = log_probs_bt - old_bt  # zero on padding
    seq_log_ratio_b = log_ratio_bt.sum(-1) / mask_bt.sum(-1).clamp(min=1)  # (batch,) log of geometric mean
    token_log_ratio_bt = log_probs_bt - log_probs_bt.detach() + seq_log_ratio_b.detach().unsqueeze(-1)
    ratio_bt = token_log_ratio_bt.clamp(max=10.0).exp()  # as verl: cap the log-ratio at 10
    unclipped_bt = -advantages_bt * ratio_bt
    clipped_bt = -advantages_bt * ratio_bt.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses_bt = torch.maximum(unclipped_bt, clipped_bt)
    metrics = {
        "clipfrac": masked_mean((clipped_bt > unclipped_bt).to(ratio_bt.dtype), mask_bt),
        "clipfrac_lower": torch.zeros((), dtype=ratio_bt.dtype, device=ratio_bt.device),
        "approx_kl": masked_mean(-log_ratio_bt, mask_bt),
    }
    return _finish(pg_losses_bt, metrics, mask_bt, tis_weights_bt, loss_agg_mode, global_normalizer)


# ---------------------------------------------------------------------------------------------------------
# value loss and entropy


def value_loss(
    values_bt: Tensor,
    old_values_bt: Tensor,
    returns_bt: Tensor,
    mask_bt: Tensor,
    *,
    loss_agg_mode: str,
    global_normalizer: float | Tensor,
    value_clip: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """0.5 * max((v - R)^2, (old_v + clip(v - old_v, +-value_clip) - R)^2), aggregated; value_clip 0 = off.

    Metrics: vf_clipfrac (clipped term larger), vpred_mean.
    """
    mask_bt = check_mask(mask_bt)
    values_bt = _masked(values_bt, "values_bt", mask_bt)
    old_bt = _masked(old_values_bt, "old_values_bt", mask_bt)
    returns_bt = _masked(returns_bt, "returns_bt", mask_bt)
    if value_clip < 0:
        raise ValueError(f"value_clip={value_clip!r} must be >= 0 (0 turns value clipping off)")
    losses_bt = (values_bt - returns_bt).square()
    clipfrac = torch.zeros((), dtype=values_bt.dtype, device=values_bt.device)
    if value_clip > 0:
        clipped_values_bt = old_bt + (values_bt - old_bt).clamp(-value_clip, value_clip)
        clipped_losses_bt = (clipped_values_bt - returns_bt).square()
        clipfrac = masked_mean((clipped_losses_bt > losses_bt).to(values_bt.dtype), mask_bt)
        losses_bt = torch.maximum(losses_bt, clipped_losses_bt)
    loss = 0.5 * agg_loss(losses_bt, mask_bt, loss_agg_mode, global_normalizer)
    metrics = {"vf_clipfrac": clipfrac, "vpred_mean": masked_mean(values_bt, mask_bt)}
    return loss, {k: v.detach() for k, v in metrics.items()}


def _entropy_rows(logits_nv: Tensor) -> Tensor:
    logits_nv = logits_nv.float() if logits_nv.dtype in (torch.float16, torch.bfloat16) else logits_nv
    probs_nv = torch.softmax(logits_nv, dim=-1)
    return torch.logsumexp(logits_nv, dim=-1) - (probs_nv * logits_nv).sum(-1)


def entropy_from_logits(logits_btv: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy of softmax(logits) over the last dim: (..., vocab) -> (...), in at least float32.

    Memory-aware: rows are processed `chunk_size` at a time, so the float32 softmax temporaries are
    (chunk, vocab) rather than (batch * resp_len, vocab); under autograd each chunk is checkpointed and
    recomputed in backward instead of keeping its softmax alive. Needs the full vocab: with vocab-parallel
    logits, gather them (or reduce the two sums over the TP group) first. Mask and aggregate with agg_loss;
    the entropy bonus is `loss = pg_loss - entropy_coef * agg_loss(entropy_bt, ...)`, done by the caller.
    """
    if logits_btv.dim() < 1 or chunk_size < 1:
        raise ValueError(f"logits_btv must have a vocab dim and chunk_size={chunk_size!r} must be >= 1")
    logits_nv = logits_btv.reshape(-1, logits_btv.shape[-1])
    needs_grad = torch.is_grad_enabled() and logits_nv.requires_grad
    entropies = []
    for start in range(0, logits_nv.shape[0], chunk_size):
        chunk_nv = logits_nv[start : start + chunk_size]
        if needs_grad:
            entropies.append(checkpoint(_entropy_rows, chunk_nv, use_reentrant=False))
        else:
            entropies.append(_entropy_rows(chunk_nv))
    if not entropies:
        return logits_btv.new_zeros(logits_btv.shape[:-1], dtype=torch.float32)
    return torch.cat(entropies).reshape(logits_btv.shape[:-1])
