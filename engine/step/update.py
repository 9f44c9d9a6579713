"""The step's update phases: the critic's and the actor's PPO updates (engine/update_phase.py) with the
tensors each loss reads, and their metrics."""

from __future__ import annotations

from engine.batch import Experience
from engine.role_losses import (
    ACTOR_FIRST_MINI_BATCH_METRICS,
    CRITIC_METRICS,
    actor_metric_names,
    make_actor_loss,
    make_critic_loss,
)
from engine.step.context import StepContext
from engine.step.stats import dp_stats
from engine.update_phase import run_updates


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
    out = run_updates(
        c.actor,
        exp,
        alg=alg,
        make_loss=lambda norm: make_actor_loss(alg, norm, kl_ref, rollout_log_probs),
        metric_names=actor_metric_names(rollout_log_probs),
        keys=tuple(keys),
        batcher=ctx.batcher,
        max_len=c.cfg.rollout.max_new_tokens,
        seed=c.cfg.trainer.seed + ctx.step,
        temperature=c.cfg.rollout.temperature,
        first_only=ACTOR_FIRST_MINI_BATCH_METRICS,
    )
    return {f"actor/{k}": v for k, v in out.items()}


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
        max_len=c.cfg.rollout.max_new_tokens,
        seed=c.cfg.trainer.seed + ctx.step,
    )
    metrics = {f"critic/{k}": v for k, v in out.items()}
    mask = exp.response_mask.bool()
    metrics["critic/returns_mean"] = dp_stats(exp.tensors["returns"][mask], c.groups)[0]
    metrics["critic/values_mean"] = dp_stats(exp.tensors["values"][mask], c.groups)[0]
    return metrics
