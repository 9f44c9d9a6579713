"""Rollout for one training DP replica: its prompts are split over the micro-DP group, each share is generated
on the rollout-layout weights, and the responses are gathered back so every rank of the replica holds all of
them (HybridFlow's data resharding around the weight transition).

`rollout` is the step's phase: the train -> rollout weight transition, the sampling parameters and seeds of
each kind of rollout, `rollout_replica` per kind, and the transition back.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.config import TrainConfig
from engine.data import stop_token_ids
from engine.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from engine.rollout.routes import cat_routes
from engine.step.context import StepContext
from parallel.rollout_weights import RolloutWeights

if TYPE_CHECKING:
    from engine.multi_turn.episode import EpisodeRunner


def share_bounds(num: int, parts: int, index: int) -> tuple[int, int]:
    base, extra = divmod(num, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def rollout_replica(
    engine: RolloutEngine,
    weights: RolloutWeights,
    prompts: list[list[int]],
    sampling: SamplingParams,
    episodes: EpisodeRunner | None = None,
    tool_names: list[list[str]] | None = None,
) -> RolloutOutput:
    """Generate `sampling.n` responses for each of this replica's prompts; identical result on every rank of
    the replica (rows in prompt order, samples of a prompt adjacent), as CPU tensors. Log-probs are present
    exactly when `sampling.log_probs` (the same on every rank: it comes from the config), whatever the backend
    returned, so the ranks agree on what they exchange and the trainer on what it logs.

    With `episodes` (rollout.multi_turn.enable) each response is a multi-turn episode with tool calls
    (engine/multi_turn/episode.py), `tool_names[p]` naming the tools prompt p may call."""
    start, end = share_bounds(len(prompts), weights.micro_dp_size, weights.micro_dp_rank)
    share = prompts[start:end]
    sampling = share_sampling(sampling, start, end)
    if share and episodes is not None:
        out = episodes.run(engine, share, sampling, tool_names[start:end] if tool_names else None)
    elif share:
        out = engine.generate(share, sampling)
    else:
        empty = torch.zeros(0, sampling.max_new_tokens if episodes is None else episodes.width)
        out = RolloutOutput(empty.long(), empty, empty, [], None if episodes is None else [])
    log_probs = None
    if sampling.log_probs:
        if out.log_probs is None:
            raise RuntimeError(
                f"{type(engine).__name__}.generate returned no log-probs though SamplingParams.log_probs was "
                "set (the contract of engine/rollout/base.py)"
            )
        log_probs = out.log_probs.cpu()
    routes = out.routed_experts if share else None  # MoE routing replay (engine/rollout/routes.py)
    local = (
        out.response_ids.cpu(),
        out.response_mask.cpu(),
        log_probs,
        out.finish_reasons,
        out.episodes,
        routes,
    )
    if weights.micro_dp_size == 1:  # the experience lives on the CPU; micro-batches go to the device
        return RolloutOutput(*local)
    gathered: list = [None] * weights.micro_dp_size
    dist.all_gather_object(gathered, local, group=weights.micro_dp_group)
    return RolloutOutput(
        response_ids=torch.cat([g[0] for g in gathered]),
        response_mask=torch.cat([g[1] for g in gathered]),
        log_probs=torch.cat([g[2] for g in gathered]) if sampling.log_probs else None,
        finish_reasons=[r for g in gathered for r in g[3]],
        episodes=None if episodes is None else [e for g in gathered for e in g[4]],
        routed_experts=cat_routes([g[5] for g in gathered if g[0].shape[0]])
        if sampling.routed_experts
        else None,
    )


def share_sampling(sampling: SamplingParams, start: int, end: int) -> SamplingParams:
    """`sampling` for prompts [start, end) of a call: the share's per-prompt limits (if any)."""
    if not sampling.max_new_tokens_per_prompt:
        return sampling
    return replace(sampling, max_new_tokens_per_prompt=sampling.max_new_tokens_per_prompt[start:end])


def row_limits(records, max_new_tokens: int) -> tuple[int, ...]:
    """Per-prompt limits from the records' `max_new_tokens` (data rows' caps); () when no record has one."""
    if all(r.max_new_tokens is None for r in records):
        return ()
    return tuple(max_new_tokens if r.max_new_tokens is None else r.max_new_tokens for r in records)


def sampling_params(
    cfg: TrainConfig, stop_ids: tuple[int, ...], greedy: bool, seed: int, temperature: float | None = None
) -> SamplingParams:
    """Sampled (rollout.n at rollout.temperature) or greedy/validation (one response per prompt)."""
    r = cfg.rollout
    if temperature is None:
        temperature = r.val_temperature if greedy else r.temperature
    return SamplingParams(
        n=1 if greedy else r.n,
        temperature=temperature,
        top_p=1.0 if greedy else r.top_p,
        top_k=0 if greedy else r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=r.ignore_eos,
        seed=seed,
        log_probs=r.log_probs and not greedy,  # greedy/val responses are only scored
        routed_experts=cfg.algorithm.router_replay and not greedy,
    )


def checkpoint_stop_ids(cfg: TrainConfig, tokenizer) -> tuple[int, ...]:
    """The ids that end a response for this run's checkpoint (model.path, or model.tokenizer_path for a
    random init): engine/data.py `stop_token_ids`."""
    return stop_token_ids(tokenizer, cfg.model.path or cfg.model.tokenizer_path)


def rollout_seed(seed: int, step: int, round_index: int, dp_rank: int, micro_dp_rank: int) -> int:
    """The sampling seed of one rollout: distinct per step, dynamic-sampling round and prompt share."""
    return (seed * 1_000_003 + step * 7919 + round_index * 15_485_863 + dp_rank * 104_729 + micro_dp_rank) % (
        2**62
    )


def rollout_params(
    cfg: TrainConfig, stop_ids: tuple[int, ...], seed: int, records
) -> dict[str, SamplingParams]:
    """The sampling parameters of each kind of rollout (`rollout`) of `records`, each prompt capped at its
    record's `max_new_tokens` where it has one, stopping at `stop_ids` (engine/data.py `stop_token_ids`);
    the rollout ranks of split placement use the same."""
    eos = stop_ids
    r = cfg.rollout
    val_sample = replace(
        sampling_params(cfg, eos, False, seed), n=r.val_n, log_probs=False, routed_experts=False
    )
    if r.val_temperature > 0:
        # verl's val_kwargs: every validation response at its temperature, top_p, top_k; another seed, or a
        # backend that seeds each row by its index (vLLM) repeats the "val" response
        val_sample = replace(
            val_sample, temperature=r.val_temperature, top_p=r.val_top_p, top_k=r.val_top_k, seed=seed + 1
        )
    params = {
        "sample": sampling_params(cfg, eos, False, seed),
        "greedy": sampling_params(cfg, eos, True, seed, temperature=0.0),
        "val": replace(sampling_params(cfg, eos, True, seed), top_p=r.val_top_p, top_k=r.val_top_k),
        "val_sample": val_sample,
    }
    limits = row_limits(records, cfg.rollout.max_new_tokens)  # the data rows' response budgets
    return {kind: replace(p, max_new_tokens_per_prompt=limits) for kind, p in params.items()}


def rollout(ctx: StepContext, records, kinds: tuple[str, ...], round_index: int = 0) -> list[RolloutOutput]:
    """One train -> rollout -> train transition and a rollout per kind: "sample" (rollout.n sampled
    responses), "greedy" (one at temperature 0: a greedy baseline), "val" (one at rollout.val_temperature),
    "val_sample" (rollout.val_n sampled ones: at val_temperature where it is > 0, else as "sample"). Every
    kind caps a prompt's responses at its record's `max_new_tokens` (the data row's budget) where it has one."""
    c, timer = ctx.c, ctx.timer
    cfg = c.cfg
    prompts = [r.prompt_ids for r in records]
    with timer.phase("reshard"):
        c.rollout_weights = c.weight_sync.to_rollout()
        c.rollout.set_weights(c.rollout_weights)
    seed = rollout_seed(
        cfg.trainer.seed, ctx.step, round_index, c.groups.dp_rank, c.rollout_weights.micro_dp_rank
    )
    params = rollout_params(cfg, checkpoint_stop_ids(cfg, c.tokenizer), seed, records)
    tool_names = [r.tools for r in records] if c.episodes is not None else None
    outs = []
    for kind in kinds:
        if c.episodes is not None:
            c.episodes.last_stats = {}  # a rank with no prompts to roll out runs no episodes
        with timer.phase("gen"):
            outs.append(
                rollout_replica(c.rollout, c.rollout_weights, prompts, params[kind], c.episodes, tool_names)
            )
        ctx.add_engine_stats(c.rollout.last_stats)
        if c.episodes is not None and kind == "sample":  # the episodes trained on: `multi_turn/*`
            ctx.add_episodes(outs[-1].episodes, c.episodes.last_stats.get("tool_s", 0.0))
    with timer.phase("reshard"):
        c.weight_sync.to_train()
        c.rollout_weights = None
    return outs
