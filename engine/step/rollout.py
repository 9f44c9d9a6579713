"""The step's rollout: the train -> rollout weight transition, the sampling parameters and seeds of each kind
of rollout, and the transition back."""

from __future__ import annotations

from dataclasses import replace

from engine.config import TrainConfig
from engine.rollout.base import RolloutOutput, SamplingParams
from engine.rollout_phase import rollout_replica
from engine.step.context import StepContext


def sampling_params(
    cfg: TrainConfig, eos_token_id: int, greedy: bool, seed: int, temperature: float | None = None
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
        stop_token_ids=(eos_token_id,),
        ignore_eos=r.ignore_eos,
        seed=seed,
        log_probs=r.log_probs and not greedy,  # greedy/val responses are only scored
    )


def rollout_seed(seed: int, step: int, round_index: int, dp_rank: int, micro_dp_rank: int) -> int:
    """The sampling seed of one rollout: distinct per step, dynamic-sampling round and prompt share."""
    return (seed * 1_000_003 + step * 7919 + round_index * 15_485_863 + dp_rank * 104_729 + micro_dp_rank) % (
        2**62
    )


def rollout(ctx: StepContext, records, kinds: tuple[str, ...], round_index: int = 0) -> list[RolloutOutput]:
    """One train -> rollout -> train transition and a rollout per kind: "sample" (rollout.n sampled
    responses), "greedy" (one at temperature 0: a greedy baseline), "val" (one at rollout.val_temperature),
    "val_sample" (rollout.val_n sampled ones)."""
    c, timer = ctx.c, ctx.timer
    cfg = c.cfg
    prompts = [r.prompt_ids for r in records]
    with timer.phase("reshard"):
        c.rollout_weights = c.weight_sync.to_rollout()
        c.rollout.set_weights(c.rollout_weights)
    seed = rollout_seed(
        cfg.trainer.seed, ctx.step, round_index, c.groups.dp_rank, c.rollout_weights.micro_dp_rank
    )
    eos = c.tokenizer.eos_token_id
    params = {
        "sample": sampling_params(cfg, eos, False, seed),
        "greedy": sampling_params(cfg, eos, True, seed, temperature=0.0),
        "val": sampling_params(cfg, eos, True, seed),
        "val_sample": replace(sampling_params(cfg, eos, False, seed), n=cfg.rollout.val_n, log_probs=False),
    }
    outs = []
    for kind in kinds:
        with timer.phase("gen"):
            outs.append(rollout_replica(c.rollout, c.rollout_weights, prompts, params[kind]))
        ctx.add_engine_stats(c.rollout.last_stats)
    with timer.phase("reshard"):
        c.weight_sync.to_train()
        c.rollout_weights = None
    return outs
