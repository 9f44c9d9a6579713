"""From one replica's scored experience to advantages and returns, following the wiring recipe of
algorithms/__init__.py: overlong shaping (already in the scores), KL in the reward, the estimator call.

Tensor code on one replica's rows (no config beyond `AlgorithmConfig`); the only communication is the
`reduce_sum` the caller passes (`dp_sum`): whitening (gae, reinforce_pp*) takes the statistics of the
whole batch over all DP replicas, as verl whitens the whole batch on its driver, so advantages do not depend
on the DP size. The trainer reduces `kl_seq_b` over DP for the KL controller. Whole prompt groups are
always on one replica, so group-relative estimators see complete groups.

Which policy log-probs the KL in the reward uses: the old-log-prob forward when it runs; otherwise
(ppo_epochs == 1 and num_mini_batches == 1, on-policy, where that forward is skipped) the rollout engine's
log-probs of the same weights, which differ from the training forward by numerics only (with
rollout.log_probs=false, or off-policy rollouts of older weights, the trainer runs the forward instead:
engine/config_rules.py `needs_old_log_prob_forward`).

`advantages` is the step's phase: `compute_advantages` over all DP replicas, the advantages' statistics, and
the KL controller's update from the batch's KL in the reward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from algorithms.advantages import get_advantage_estimator
from algorithms.kl import get_kl_estimator, scores_to_token_rewards
from engine.config import AlgorithmConfig
from engine.step.batch import Experience
from engine.step.stats import dp_stats
from parallel.state import ProcessGroups


def policy_log_probs(exp: Experience) -> torch.Tensor:
    """(rows, T) the actor's log-probs before the update: old-log-prob forward, else the rollout's."""
    if "old_log_probs" in exp.tensors:
        return exp.tensors["old_log_probs"]
    if "rollout_log_probs" not in exp.tensors:  # the trainer runs the forward when the rollout returns none
        raise RuntimeError(
            "the KL in the reward needs the policy's log-probs: no old-log-prob forward ran and the rollout "
            "returned none; run the old-log-prob forward (engine/config_rules.py needs_old_log_prob_forward)"
        )
    return exp.tensors["rollout_log_probs"]


def dp_sum(group: dist.ProcessGroup, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A `reduce_sum` for the estimators: the sum of a tensor over the DP replicas of `group` (all_reduce on
    `device`, the result back on the tensor's device)."""

    def reduce_sum(x: torch.Tensor) -> torch.Tensor:
        total = x.to(device)
        dist.all_reduce(total, group=group)
        return total.to(x.device)

    return reduce_sum


@torch.no_grad()
def compute_advantages(
    exp: Experience,
    alg: AlgorithmConfig,
    kl_coef: float,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Tensors to add to `exp.tensors`: advantages, returns, token_rewards (rows, T); with KL in the reward
    also kl (rows, T) and kl_seq (rows,), each row's token-mean KL (what the KL controller reads).

    Reads exp.tensors: scores, overlong_penalty (optional), baseline_scores (remax), values (gae),
    ref_log_probs and old_log_probs/rollout_log_probs (KL in the reward). `reduce_sum`: sums a tensor over
    the DP replicas (`dp_sum`), for whitening over the whole batch; None = these rows are the whole batch.
    Collective when given: every replica calls it with the same config.
    """
    mask = exp.response_mask
    scores_b = exp.tensors["scores"]
    if "overlong_penalty" in exp.tensors:
        scores_b = scores_b + exp.tensors["overlong_penalty"]
    out: dict[str, torch.Tensor] = {}
    kl_bt = None
    if alg.kl_in_reward:
        kl_bt = get_kl_estimator(alg.kl_estimator)(policy_log_probs(exp), exp.tensors["ref_log_probs"], mask)
        out["kl"] = kl_bt
        out["kl_seq"] = kl_bt.sum(-1) / mask.sum(-1).clamp(min=1)
    token_rewards_bt = scores_to_token_rewards(scores_b, mask, kl_bt=kl_bt, kl_coef=kl_coef)
    # outcome estimators take one reward per response: with KL in the reward, the KL-shaped sum
    seq_rewards_b = scores_b if kl_bt is None else token_rewards_bt.sum(-1)
    advantages_bt, returns_bt = get_advantage_estimator(alg.adv_estimator)(
        mask_bt=mask,
        scores_b=seq_rewards_b,
        group_index_b=exp.group_index,
        token_rewards_bt=token_rewards_bt,
        values_bt=exp.tensors.get("values"),
        baseline_scores_b=exp.tensors.get("baseline_scores"),
        gamma=alg.gamma,
        lam=alg.lam,
        norm_by_std=alg.norm_adv_by_std,
        reduce_sum=reduce_sum,
    )
    out.update(advantages=advantages_bt, returns=returns_bt, token_rewards=token_rewards_bt)
    return out


def advantages(exp: Experience, alg: AlgorithmConfig, kl_ctrl, groups: ProcessGroups) -> dict[str, float]:
    """Add advantages and returns (and the reward's KL) to `exp.tensors`; update `kl_ctrl` (a KL controller of
    algorithms/kl.py) when the KL is in the reward. Returns the `actor/adv_*` and `actor/reward_kl_*` metrics."""
    kl_coef = kl_ctrl.value
    exp.tensors.update(compute_advantages(exp, alg, kl_coef, dp_sum(groups.dp, groups.device)))
    mask = exp.response_mask.bool()
    mean, std, lo, hi = dp_stats(exp.tensors["advantages"][mask], groups)
    out = {"actor/adv_mean": mean, "actor/adv_std": std, "actor/adv_min": lo, "actor/adv_max": hi}
    if alg.kl_in_reward:
        kl_seq = exp.tensors["kl_seq"]
        moments = torch.tensor([float(kl_seq.double().sum()), float(kl_seq.numel())], device=groups.device)
        dist.all_reduce(moments, group=groups.dp)
        current_kl = float(moments[0]) / max(float(moments[1]), 1.0)
        kl_ctrl.update(current_kl, n_steps=int(moments[1]))
        out["actor/reward_kl_penalty"] = current_kl
        out["actor/reward_kl_coef"] = kl_coef
    return out
