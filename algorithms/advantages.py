"""Advantage estimators: from rewards (and values) to per-token advantages and returns.

Every estimator is registered by name and has the SAME keyword-only signature, so a trainer can call
any of them with everything it has and let each one take what it needs:

    advantages_bt, returns_bt = get_advantage_estimator(name)(
        mask_bt=..., scores_b=..., group_index_b=..., token_rewards_bt=..., values_bt=...,
        baseline_scores_b=..., gamma=..., lam=..., norm_by_std=..., whiten=..., reduce_sum=...)

Inputs (a missing required one raises ValueError naming it; unused ones are ignored):
    mask_bt            (batch, resp_len) 1 on response tokens that are trained on, 0 on padding
    scores_b           (batch,) one scalar reward per response (outcome reward)
    group_index_b      (batch,) int id of the prompt each response answers; members of a group need
                       NOT be adjacent
    token_rewards_bt   (batch, resp_len) per-token reward, e.g. `kl.scores_to_token_rewards(...)`
    values_bt          (batch, resp_len) critic values
    baseline_scores_b  (batch,) reward of the greedy response to the same prompt (ReMax)
    reduce_sum         whitening over a batch sharded across calls (DP replicas): a function that sums a
                       tensor over all shards, e.g. an all_reduce over the DP group; None = the call holds
                       the whole batch

    name                   needs                          advantage per valid token
    gae                    token_rewards_bt, values_bt    GAE(gamma, lam), whitened if `whiten`
    grpo                   scores_b, group_index_b        (s - group mean) / (group std + eps); no std if not norm_by_std
    rloo                   scores_b, group_index_b        s - mean of the OTHER members of the group
    opo                    scores_b, group_index_b        s - sum(len * s) / sum(len) over the group
    reinforce_pp           token_rewards_bt               discounted return-to-go, whitened over valid tokens
    reinforce_pp_baseline  scores_b, group_index_b        s - group mean, whitened over valid tokens
    remax                  token_rewards_bt, baseline_s   reward-to-go of the token rewards - baseline_s (verl)

Outputs: advantages_bt and returns_bt, both (batch, resp_len), zero on padding. returns_bt is the value
target (GAE: advantages + values before whitening; reinforce_pp: discounted return-to-go; the outcome
estimators: the score on every valid token; remax: the reward-to-go). If KL is in the reward, pass the
KL-shaped sequence reward as scores_b (the sum of token_rewards_bt over valid tokens), as verl does.

Departures and choices, on purpose:
- A group of one response has no baseline: its advantage is its raw score (grpo, rloo, opo,
  reinforce_pp_baseline), as in verl. The group std is Bessel-corrected (torch.std), as in verl and TRL.
- Padding inside a response (multi-turn observation tokens, mask 0) is skipped by the recursions of gae
  and reinforce_pp: the return flows across the hole unchanged (verl's reinforce_plus_plus resets it to 0
  there, so an earlier turn's tokens would not see the final reward; its GAE skips holes as ours does).
- Whitening (gae, reinforce_pp, reinforce_pp_baseline) is verl's `masked_whiten` over the whole batch (verl
  whitens on its driver): masked mean, Bessel-corrected variance, eps 1e-8. A sharded batch passes
  `reduce_sum`, which every shard must call (the same estimator on every shard), so the advantages do not
  depend on the number of shards; never call an estimator per micro-batch.
All estimators run under torch.no_grad(): advantages are constants for the policy loss.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from algorithms._common import (
    Registry,
    broadcast_to_tokens,
    check_group_index,
    check_like_mask,
    check_mask,
    check_per_sequence,
    masked_whiten,
)

AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]
_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "adv_estimator")


@dataclass(frozen=True)
class AdvantageTraits:
    """What an estimator needs from the step and which `algorithm.*` settings it reads; the engine asks these
    instead of branching on names."""

    needs_critic: bool = False
    """Reads values_bt: the run builds a value model (critic) and updates it."""
    needs_greedy_baseline: bool = False
    """Reads baseline_scores_b: the score of one greedy response per prompt, rolled out alongside."""
    group_relative: bool = False
    """Compares the responses to one prompt (rollout.n >= 2 needed)."""
    uses_gamma: bool = False
    """Discounts token rewards with `gamma`."""
    uses_lam: bool = False
    """Reads GAE's `lam`."""
    uses_norm_by_std: bool = False
    """Reads `norm_by_std` (divides by the group std)."""


_TRAITS: dict[str, AdvantageTraits] = {}


def register_advantage(
    name: str, traits: AdvantageTraits = AdvantageTraits()
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register an estimator with the common keyword-only signature under `name`, with the
    `traits` the engine asks (`advantage_traits`)."""
    register = _ESTIMATORS.register(name)

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        fn = register(fn)
        _TRAITS[name] = traits
        return fn

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; ValueError listing the known names otherwise."""
    return _ESTIMATORS.get(name)


def advantage_traits(name: str) -> AdvantageTraits:
    """The traits the estimator `name` was registered with; ValueError listing the known names otherwise."""
    _ESTIMATORS.get(name)
    return _TRAITS[name]


def advantage_estimator_names() -> list[str]:
    return _ESTIMATORS.names()


# ---------------------------------------------------------------------------------------------------------
# group statistics (groups given by ids, in any order)


def _group_sum(x_b: Tensor, inverse_b: Tensor, num_groups: int) -> Tensor:
    """Sum of x over each group, gathered back to every member: (batch,)."""
    sum_g = torch.zeros(num_groups, dtype=x_b.dtype, device=x_b.device).index_add_(0, inverse_b, x_b)
    return sum_g[inverse_b]


def _group_baseline_inputs(scores_b: Tensor, group_index_b: Tensor) -> tuple[Tensor, int, Tensor]:
    """Group of each response as 0..G-1, the number of groups G and each response's group size."""
    group_ids_g, inverse_b = torch.unique(group_index_b, return_inverse=True)
    num_groups = group_ids_g.numel()
    count_b = _group_sum(torch.ones_like(scores_b), inverse_b, num_groups)
    return inverse_b, num_groups, count_b


def _check_scores(scores_b: Tensor | None, mask_bt: Tensor, arg_name: str = "scores_b") -> Tensor:
    scores_b = check_per_sequence(scores_b, arg_name, mask_bt)
    if not scores_b.dtype.is_floating_point:
        raise ValueError(f"{arg_name} must be a floating-point tensor, got dtype {scores_b.dtype}")
    return scores_b


def _outcome(scores_b: Tensor, advantages_b: Tensor, mask_bt: Tensor) -> tuple[Tensor, Tensor]:
    return broadcast_to_tokens(advantages_b, mask_bt), broadcast_to_tokens(scores_b, mask_bt)


# ---------------------------------------------------------------------------------------------------------
# estimators; all share the signature documented in the module docstring


@register_advantage("gae", AdvantageTraits(needs_critic=True, uses_gamma=True, uses_lam=True))
@torch.no_grad()
def gae_advantages(
    *,
    mask_bt: Tensor,
    scores_b: Tensor | None = None,
    group_index_b: Tensor | None = None,
    token_rewards_bt: Tensor | None = None,
    values_bt: Tensor | None = None,
    baseline_scores_b: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over valid tokens."""
    mask_bt = check_mask(mask_bt)
    rewards_bt = check_like_mask(token_rewards_bt, "token_rewards_bt", mask_bt)
    values_bt = check_like_mask(values_bt, "values_bt", mask_bt)
    zero = torch.zeros((), dtype=values_bt.dtype, device=values_bt.device)
    rewards_bt = torch.where(mask_bt, rewards_bt, zero)
    values_bt = torch.where(mask_bt, values_bt, zero)

    next_value_b = torch.zeros_like(values_bt[:, 0])  # value after the last valid token is 0 (terminal)
    last_gae_b = torch.zeros_like(values_bt[:, 0])
    advantages_t = []
    for t in reversed(range(mask_bt.shape[1])):
        valid_b = mask_bt[:, t]
        delta_b = rewards_bt[:, t] + gamma * next_value_b - values_bt[:, t]
        gae_b = delta_b + gamma * lam * last_gae_b
        # a padded position passes the next valid token's value and advantage through unchanged
        next_value_b = torch.where(valid_b, values_bt[:, t], next_value_b)
        last_gae_b = torch.where(valid_b, gae_b, last_gae_b)
        advantages_t.append(last_gae_b)
    advantages_bt = torch.stack(advantages_t[::-1], dim=1)  # (batch, resp_len)
    returns_bt = torch.where(mask_bt, advantages_bt + values_bt, zero)
    if whiten:
        return masked_whiten(advantages_bt, mask_bt, reduce_sum=reduce_sum), returns_bt
    return torch.where(mask_bt, advantages_bt, zero), returns_bt


@register_advantage("grpo", AdvantageTraits(group_relative=True, uses_norm_by_std=True))
@torch.no_grad()
def grpo_advantages(
    *,
    mask_bt: Tensor,
    scores_b: Tensor | None = None,
    group_index_b: Tensor | None = None,
    token_rewards_bt: Tensor | None = None,
    values_bt: Tensor | None = None,
    baseline_scores_b: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): group-normalised score; `norm_by_std=False` is Dr.GRPO (Liu et al. 2025).

    The group moments are taken in float64: a group whose rewards are all equal (common without dynamic
    sampling) must get advantage 0, and in float32 the mean of n equal values (0.7 x 16) is off by a rounding
    residual d that the std (~|d|) then scales towards +-1: the same sign for the whole group, a biased update
    (measured: +0.106 for 16 x 0.7, up to 0.81 at 64). In float64 the mean of equal float32 values is exact."""
    mask_bt = check_mask(mask_bt)
    scores_b = _check_scores(scores_b, mask_bt)
    group_index_b = check_group_index(group_index_b, mask_bt)
    wide_b = scores_b.double()
    inverse_b, num_groups, count_b = _group_baseline_inputs(wide_b, group_index_b)
    mean_b = _group_sum(wide_b, inverse_b, num_groups) / count_b
    advantages_b = torch.where(count_b > 1, wide_b - mean_b, wide_b)
    if norm_by_std:
        sq_dev_b = _group_sum((wide_b - mean_b).square(), inverse_b, num_groups)
        std_b = torch.where(count_b > 1, (sq_dev_b / (count_b - 1).clamp(min=1)).sqrt(), 1.0)
        advantages_b = advantages_b / (std_b + eps)
    return _outcome(scores_b, advantages_b.to(scores_b.dtype), mask_bt)


@register_advantage("rloo", AdvantageTraits(group_relative=True))
@torch.no_grad()
def rloo_advantages(
    *,
    mask_bt: Tensor,
    scores_b: Tensor | None = None,
    group_index_b: Tensor | None = None,
    token_rewards_bt: Tensor | None = None,
    values_bt: Tensor | None = None,
    baseline_scores_b: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024): baseline is the mean score of the other responses to the prompt."""
    mask_bt = check_mask(mask_bt)
    scores_b = _check_scores(scores_b, mask_bt)
    group_index_b = check_group_index(group_index_b, mask_bt)
    inverse_b, num_groups, count_b = _group_baseline_inputs(scores_b, group_index_b)
    others_sum_b = _group_sum(scores_b, inverse_b, num_groups) - scores_b
    baseline_b = torch.where(count_b > 1, others_sum_b / (count_b - 1).clamp(min=1), 0.0)
    return _outcome(scores_b, scores_b - baseline_b, mask_bt)


@register_advantage("opo", AdvantageTraits(group_relative=True))
@torch.no_grad()
def opo_advantages(
    *,
    mask_bt: Tensor,
    scores_b: Tensor | None = None,
    group_index_b: Tensor | None = None,
    token_rewards_bt: Tensor | None = None,
    values_bt: Tensor | None = None,
    baseline_scores_b: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """OPO (Hao et al. 2025): the length-weighted group mean score is the baseline; length = valid tokens."""
    mask_bt = check_mask(mask_bt)
    scores_b = _check_scores(scores_b, mask_bt)
    group_index_b = check_group_index(group_index_b, mask_bt)
    inverse_b, num_groups, count_b = _group_baseline_inputs(scores_b, group_index_b)
    lengths_b = mask_bt.sum(-1).to(scores_b.dtype)
    weighted_b = _group_sum(lengths_b * scores_b, inverse_b, num_groups)
    total_len_b = _group_sum(lengths_b, inverse_b, num_groups)
    baseline_b = torch.where(count_b > 1, weighted_b / total_len_b.clamp(min=1), 0.0)
    return _outcome(scores_b, scores_b - baseline_b, mask_bt)


@register_advantage("reinforce_pp", AdvantageTraits(uses_gamma=True))
@torch.no_grad()
def reinforce_pp_advantages(
    *,
    mask_bt: Tensor,
    scores_b: Tensor | None = None,
    group_index_b: Tensor | None = None,
    token_rewards_bt: Tensor | None = None,
    values_bt: Tensor | None = None,
    baseline_scores_b: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go of (KL-shaped) token rewards, globally whitened."""
    mask_bt = check_mask(mask_bt)
    rewards_bt = check_like_mask(token_rewards_bt, "token_rewards_bt", mask_bt)
    zero = torch.zeros((), dtype=rewards_bt.dtype, device=rewards_bt.device)
    rewards_bt = torch.where(mask_bt, rewards_bt, zero)
    running_b = torch.zeros_like(rewards_bt[:, 0])
    returns_t = []
    for t in reversed(range(mask_bt.shape[1])):
        running_b = torch.where(mask_bt[:, t], rewards_bt[:, t] + gamma * running_b, running_b)
        returns_t.append(running_b)
    returns_bt = torch.where(mask_bt, torch.stack(returns_t[::-1], dim=1), zero)  # (batch, resp_len)
    return masked_whiten(returns_bt, mask_bt, reduce_sum=reduce_sum), returns_bt


@register_advantage("reinforce_pp_baseline", AdvantageTraits(group_relative=True))
@torch.no_grad()
def reinforce_pp_baseline_advantages(
    *,
    mask_bt: Tensor,
    scores_b: Tensor | None = None,
    group_index_b: Tensor | None = None,
    token_rewards_bt: Tensor | None = None,
    values_bt: Tensor | None = None,
    baseline_scores_b: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with baseline: score minus group mean, then whitened over all valid tokens."""
    mask_bt = check_mask(mask_bt)
    scores_b = _check_scores(scores_b, mask_bt)
    group_index_b = check_group_index(group_index_b, mask_bt)
    inverse_b, num_groups, count_b = _group_baseline_inputs(scores_b, group_index_b)
    mean_b = _group_sum(scores_b, inverse_b, num_groups) / count_b
    centered_b = torch.where(count_b > 1, scores_b - mean_b, scores_b)
    advantages_bt = masked_whiten(broadcast_to_tokens(centered_b, mask_bt), mask_bt, reduce_sum=reduce_sum)
    return advantages_bt, broadcast_to_tokens(scores_b, mask_bt)


@register_advantage("remax", AdvantageTraits(needs_greedy_baseline=True))
@torch.no_grad()
def remax_advantages(
    *,
    mask_bt: Tensor,
    scores_b: Tensor | None = None,
    group_index_b: Tensor | None = None,
    token_rewards_bt: Tensor | None = None,
    values_bt: Tensor | None = None,
    baseline_scores_b: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023) as verl's compute_remax_outcome_advantage: at each valid token, the (undiscounted)
    reward-to-go of the token rewards minus the score of the greedy response to the same prompt. Without a KL
    in the reward that is score - baseline on every token; with it, each token's advantage carries only the KL
    penalties of the tokens from it onwards. returns_bt: the reward-to-go."""
    mask_bt = check_mask(mask_bt)
    rewards_bt = check_like_mask(token_rewards_bt, "token_rewards_bt", mask_bt)
    baseline_scores_b = _check_scores(baseline_scores_b, mask_bt, "baseline_scores_b")
    zero = torch.zeros((), dtype=rewards_bt.dtype, device=rewards_bt.device)
    rewards_bt = torch.where(mask_bt, rewards_bt, zero)
    returns_bt = torch.where(mask_bt, rewards_bt.flip(-1).cumsum(-1).flip(-1), zero)  # (batch, resp_len)
    advantages_bt = torch.where(mask_bt, returns_bt - baseline_scores_b[:, None].to(returns_bt.dtype), zero)
    return advantages_bt, returns_bt
