"""The PPO update of one trainable role (actor or critic): epochs x mini-batches x micro-batches through
`MegatronRole.run`, one optimizer step per mini-batch, and the metric sums reduced onto every rank.

Mini-batches are contiguous row ranges, so the n responses of a prompt stay together; their order is
shuffled per epoch with a seed shared by all ranks. Each mini-batch's loss normaliser is summed over DP
first (the contract of engine/roles/policy.py), so the update does not depend on how rows are split.

`update_actor` and `update_critic` are the step's update phases: `run_updates` with the tensors each role's
loss reads (engine/step/losses.py), and their metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from algorithms.losses import loss_normalizer
from engine.config import AlgorithmConfig, TrainConfig
from engine.config_rules import max_response_tokens
from engine.models.builder import ModelShape
from engine.roles.dynamic_batch import MicroBatcher
from engine.roles.policy import LossFn, MegatronRole
from engine.roles.router_load import RouterLoad
from engine.step.batch import Experience
from engine.step.context import StepContext
from engine.step.losses import (
    ACTOR_FIRST_MINI_BATCH_METRICS,
    CRITIC_METRICS,
    actor_metric_names,
    make_actor_loss,
    make_critic_loss,
)
from engine.step.stats import dp_stats


def loss_max_len(cfg: TrainConfig) -> int:
    """The constant length seq-mean-token-sum-norm divides each sequence's loss sum by: the most tokens of one
    response (`max_response_tokens`: rollout.max_new_tokens, or a multi-turn episode's
    rollout.multi_turn.max_total_tokens), as verl divides by its response width (response_length, which
    holds a whole episode under its agent loop)."""
    return max_response_tokens(cfg.rollout)


def run_updates(
    role: MegatronRole,
    exp: Experience,
    *,
    alg: AlgorithmConfig,
    make_loss: Callable[[float], LossFn],
    metric_names: tuple[str, ...],
    keys: tuple[str, ...],
    batcher: MicroBatcher,
    max_len: int,
    seed: int,
    temperature: float = 1.0,
    first_only: tuple[str, ...] = (),
) -> dict[str, float]:
    """Run the updates; returns {names ending in "loss": mean per optimizer step (loss_fn returns each
    micro-batch's share), other names: means over valid tokens of all updates, "grad_norm": mean over the
    applied optimizer steps (0 if none), "lr": last, "loss_scale": after the last optimizer step,
    "skipped_steps": optimizer steps skipped because float16 gradients overflowed}, identical on every rank.
    Names in `first_only` are means over the valid tokens of the first mini-batch of the first epoch instead:
    the forward before any optimizer step (e.g. rollout_kl, which must not include the update's own drift)."""
    g = role.groups
    sums = torch.zeros(len(metric_names) + 1, dtype=torch.float64)
    first_sums = None  # the first mini-batch's sums
    grad_norms, lrs, skipped = [], [], 0
    rows_per_mini = exp.num_rows // alg.num_mini_batches
    gen = torch.Generator().manual_seed(seed)
    for _ in range(alg.ppo_epochs):
        for mini in torch.randperm(alg.num_mini_batches, generator=gen).tolist():
            rows = torch.arange(mini * rows_per_mini, (mini + 1) * rows_per_mini)
            norm = torch.tensor(
                loss_normalizer(exp.response_mask[rows], alg.loss_agg_mode, max_len=max_len),
                dtype=torch.float64,
                device=g.device,
            )
            dist.all_reduce(norm, group=g.dp)
            outs = role.run(
                batcher(exp, rows, keys), make_loss(float(norm)), forward_only=False, temperature=temperature
            )
            mini_sums = torch.zeros_like(sums)
            for o in outs:
                mini_sums += torch.tensor(
                    [float(o[k]) for k in metric_names] + [float(o["tokens"])], dtype=torch.float64
                )
            sums += mini_sums
            if first_sums is None:
                first_sums = mini_sums
            stats = role.optimizer_step()
            if stats.skipped:
                skipped += 1
            else:
                grad_norms.append(stats.grad_norm)
            lrs.append(stats.lr)
    role.release_graphs()
    # metrics live on the last PP stage, once per TP group: sum them onto every rank
    both = torch.cat([sums, first_sums])
    if not (g.is_last_stage and g.tp_rank == 0):
        both.zero_()
    both = both.to(g.device)
    dist.all_reduce(both, group=g.world)
    sums, first_sums = both.cpu().split(len(sums))
    tokens, first_tokens = max(float(sums[-1]), 1.0), max(float(first_sums[-1]), 1.0)
    steps = alg.ppo_epochs * alg.num_mini_batches
    out = {
        name: float(first_sums[i]) / first_tokens
        if name in first_only
        else float(sums[i]) / (steps if name.endswith("loss") else tokens)
        for i, name in enumerate(metric_names)
    }
    out["grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
    out["lr"] = lrs[-1]
    out["loss_scale"] = stats.loss_scale
    out["skipped_steps"] = skipped
    return out


def pipeline_rows(num_rows: int, micro_batch_size: int, pp: int, vpp: int) -> torch.Tensor:
    """Row indices for a forward-only call with fixed micro-batches at PP > 1: 0..num_rows-1, then the last
    row repeated until every micro-batch is full (the stages size their receive buffers from the first
    micro-batch) and, under the interleaved schedule (vpp > 1), until the count of micro-batches is a
    multiple of pp (megatron's rule with its default group of pp micro-batches). The caller drops the
    repeats: positions >= num_rows."""
    num_mbs = max(-(-num_rows // micro_batch_size), 1)
    if vpp > 1:
        num_mbs = -(-num_mbs // pp) * pp
    rows = torch.arange(num_mbs * micro_batch_size)
    return rows.clamp(max=num_rows - 1)


def forward_rows(
    role: MegatronRole, exp: Experience, fn: LossFn, key: str, batcher: MicroBatcher, temperature: float = 1.0
) -> torch.Tensor:
    """Forward-only pass over all rows: `fn`'s (b, T) output `key`, reassembled in row order (rows, T) on
    every PP stage, on CPU. Any row count works: at PP > 1 micro-batches of `micro_batch_size` rows in order
    (`batcher.fixed_rows`) are padded with repeated rows whose outputs are dropped (`pipeline_rows`); rows
    grouped by tokens (packed, or under a budget) exchange shapes instead."""
    g = role.groups
    num_rows = exp.num_rows
    rows = torch.arange(num_rows)
    if g.dims.pp > 1 and batcher.fixed_rows and num_rows:
        rows = pipeline_rows(num_rows, batcher.micro_batch_size, g.dims.pp, g.dims.vpp)
    mbs = batcher(exp, rows)
    outs = role.run(mbs, fn, forward_only=True, temperature=temperature)
    shape = tuple(exp.response_ids.shape)
    local = None
    if outs:
        local = torch.zeros(shape, dtype=torch.float32)
        start = 0
        for mb, o in zip(mbs, outs):
            # the micro-batch's rows, in order; the padded tail of `rows` (positions >= num_rows) is dropped
            keep = max(min(len(mb["rows"]), num_rows - start), 0)
            local[mb["rows"][:keep]] = o[key][:keep].float().cpu()
            start += len(mb["rows"])
        local = local.to(g.device)
    role.release_graphs()
    return role.broadcast_from_last_stage(local, shape, torch.float32).cpu()


def update_actor(
    ctx: StepContext, exp: Experience, old_log_probs: bool, kl_ref: bool, rollout_log_probs: bool
) -> dict[str, float]:
    """The actor's update; `old_log_probs`, `kl_ref`, `rollout_log_probs`: whether `exp` holds them."""
    c = ctx.c
    alg = c.cfg.algorithm
    keys = ["advantages"]
    if rollout_log_probs:
        keys.append("rollout_log_probs")
    if old_log_probs:
        keys.append("old_log_probs")
    if kl_ref:
        keys.append("ref_log_probs")
    load = router_load(c.actor, c.shape)
    with load or contextlib.nullcontext():
        out = run_updates(
            c.actor,
            exp,
            alg=alg,
            make_loss=lambda norm: make_actor_loss(alg, norm, kl_ref, rollout_log_probs),
            metric_names=actor_metric_names(rollout_log_probs, alg.tis_cap > 0),
            keys=tuple(keys),
            batcher=ctx.batcher,
            max_len=loss_max_len(c.cfg),
            seed=c.cfg.trainer.seed + ctx.step,
            temperature=c.cfg.rollout.temperature,
            first_only=ACTOR_FIRST_MINI_BATCH_METRICS,
        )
    if load is not None:
        out.update(load.metrics())
    if c.actor.router_replay is not None:  # over this step's actor forwards (old log-probs and update)
        out.update(c.actor.router_replay.metrics())
    return {f"actor/{k}": v for k, v in out.items()}


def router_load(role: MegatronRole, shape: ModelShape) -> RouterLoad | None:
    """The router statistics of an MoE role's update (engine/roles/router_load.py); None for a dense model."""
    if shape.moe is None:
        return None
    g = role.groups
    return RouterLoad(role.chunks, shape.num_layers, shape.moe.num_experts, g.world, g.device)


def update_critic(ctx: StepContext, exp: Experience) -> dict[str, float]:
    """The critic's update, and the mean returns and values over all DP replicas."""
    c = ctx.c
    alg = c.cfg.algorithm
    out = run_updates(
        c.critic,
        exp,
        alg=alg,
        make_loss=lambda norm: make_critic_loss(alg, norm),
        metric_names=CRITIC_METRICS,
        keys=("values", "returns"),
        batcher=ctx.batcher,
        max_len=loss_max_len(c.cfg),
        seed=c.cfg.trainer.seed + ctx.step,
    )
    metrics = {f"critic/{k}": v for k, v in out.items()}
    mask = exp.response_mask.bool()
    metrics["critic/returns_mean"] = dp_stats(exp.tensors["returns"][mask], c.groups)[0]
    metrics["critic/values_mean"] = dp_stats(exp.tensors["values"][mask], c.groups)[0]
    return metrics
