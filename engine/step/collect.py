"""The step's responses on this replica: one rollout round, or with dynamic sampling (DAPO) further rounds
while the batch lacks informative groups, selected over all replicas' responses
(engine/step/dynamic_sampling.py); then, over 2 or more DP replicas, re-dealt so that each holds near the
same tokens in every mini-batch (`trainer.balance_batch`, engine/step/balance.py). Under split placement the
rollout ranks generate and score every round (`TrainerLink.collect`); the selection runs here on the training
ranks, which tell the rollout ranks whether another round is needed (`TrainerLink.next_round`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.step.balance import balance, balanced_share
from engine.step.batch import Responses
from engine.step.context import StepContext
from engine.step.dynamic_sampling import GroupSelector, global_order, replica_share
from engine.step.reward import scored_responses


def collect(ctx: StepContext) -> tuple[Responses, dict[str, float]]:
    """This replica's scored responses for the step, the `dynamic_sampling/*` metrics (none without) and the
    `perf/dp_imbalance*` ones (over 2 or more replicas with trainer.balance_batch)."""
    c = ctx.c
    alg, g = c.cfg.algorithm, c.groups
    balanced = c.cfg.trainer.balance_batch and g.dims.dp > 1  # engine/step/balance.py
    if not alg.dynamic_sampling:
        if c.split is not None:  # split placement: the rollout ranks generate and score
            responses, side_metrics = c.split.collect(ctx)
        else:
            responses, side_metrics = scored_responses(ctx, c.loader.next_batch(), 0), {}
        if not balanced:
            return responses, side_metrics
        responses, balance_metrics = balance(responses, g, alg.num_mini_batches)
        return responses, {**side_metrics, **balance_metrics}
    selector = GroupSelector(c.cfg.data.batch_size)
    rounds, side_metrics = 0, {}
    while True:
        parts: list[Responses | None] = [None] * g.dims.dp
        if c.split is not None:  # the rollout ranks generate and score each round
            mine, side_metrics = c.split.collect(ctx, rounds)
        else:
            mine = scored_responses(ctx, c.loader.next_batch(), rounds)
        dist.all_gather_object(parts, mine, group=g.dp)
        selector.add(global_order(parts, alg.num_mini_batches))
        rounds += 1
        missing = torch.tensor(float(selector.missing), device=g.device)
        dist.all_reduce(missing, op=dist.ReduceOp.MAX, group=g.world)
        done = float(missing) == 0 or rounds >= alg.max_sampling_rounds
        if c.split is not None:
            c.split.next_round(not done)
        if done:
            break
    batch, counts = selector.finish()  # the same on every replica: counts are global
    if balanced:
        responses, balance_metrics = balanced_share(batch, g.dp_rank, g.dims.dp, alg.num_mini_batches)
    else:
        responses, balance_metrics = replica_share(batch, g.dp_rank, g.dims.dp, alg.num_mini_batches), {}
    return responses, {
        **side_metrics,
        **balance_metrics,
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/generated_groups": float(counts["generated"]),
        "dynamic_sampling/dropped_groups": float(counts["dropped"]),
        "dynamic_sampling/filler_groups": float(counts["filler"]),
    }
