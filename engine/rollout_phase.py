"""Rollout for one training DP replica: its prompts are split over the micro-DP group, each share is generated
on the rollout-layout weights, and the responses are gathered back so every rank of the replica holds all of
them (HybridFlow's data resharding around the weight transition)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from parallel.rollout_weights import RolloutWeights


def _share_bounds(num: int, parts: int, index: int) -> tuple[int, int]:
    base, extra = divmod(num, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def rollout_replica(
    engine: RolloutEngine, weights: RolloutWeights, prompts: list[list[int]], sampling: SamplingParams
) -> RolloutOutput:
    """Generate `sampling.n` responses for each of this replica's prompts; identical result on every rank of
    the replica (rows in prompt order, samples of a prompt adjacent), as CPU tensors. Log-probs are present
    exactly when `sampling.log_probs` (the same on every rank: it comes from the config), whatever the backend
    returned, so the ranks agree on what they exchange and the trainer on what it logs."""
    start, end = _share_bounds(len(prompts), weights.micro_dp_size, weights.micro_dp_rank)
    share = prompts[start:end]
    if share:
        out = engine.generate(share, sampling)
    else:
        empty = torch.zeros(0, sampling.max_new_tokens)
        out = RolloutOutput(empty.long(), empty, empty, [])
    log_probs = None
    if sampling.log_probs:
        if out.log_probs is None:
            raise RuntimeError(
                f"{type(engine).__name__}.generate returned no log-probs though SamplingParams.log_probs was "
                "set (the contract of engine/rollout/base.py)"
            )
        log_probs = out.log_probs.cpu()
    local = (out.response_ids.cpu(), out.response_mask.cpu(), log_probs, out.finish_reasons)
    if weights.micro_dp_size == 1:  # the experience lives on the CPU; micro-batches go to the device
        return RolloutOutput(*local)
    gathered: list = [None] * weights.micro_dp_size
    dist.all_gather_object(gathered, local, group=weights.micro_dp_group)
    return RolloutOutput(
        response_ids=torch.cat([g[0] for g in gathered]),
        response_mask=torch.cat([g[1] for g in gathered]),
        log_probs=torch.cat([g[2] for g in gathered]) if sampling.log_probs else None,
        finish_reasons=[r for g in gathered for r in g[3]],
    )
