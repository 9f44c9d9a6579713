"""The step's advantages phase: advantages and returns over all DP replicas (engine/advantage_phase.py), their
statistics, and the KL controller's update from the batch's KL in the reward."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.advantage_phase import compute_advantages, dp_sum
from engine.batch import Experience
from engine.config import AlgorithmConfig
from engine.step.stats import dp_stats
from parallel.state import ProcessGroups


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
