"""The step's reward: decode the responses, score them (rule or user function, and/or the reward model),
DAPO's overlong penalty, and the greedy baseline of estimators that need one (ReMax)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from algorithms.advantages import advantage_traits
from algorithms.dapo import overlong_penalty
from engine.config_rules import max_response_tokens, overlong_buffer_tokens
from engine.roles.dynamic_batch import MicroBatcher
from engine.rollout.base import RolloutOutput
from engine.step.batch import Responses, response_lengths
from engine.step.context import StepContext
from engine.step.rollout import rollout

if TYPE_CHECKING:
    from engine.setup import Components


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """The text of each response row (its valid tokens, special tokens skipped; a multi-turn episode's whole
    response, tool turns included)."""
    lengths = response_lengths(response_mask)
    return [
        tokenizer.decode(response_ids[r, : int(lengths[r])].tolist(), skip_special_tokens=True)
        for r in range(response_ids.shape[0])
    ]


def score(
    c: Components,
    out: RolloutOutput,
    records,
    n: int,
    batcher: MicroBatcher,
    texts: list[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Reward-function scores (rows,), the overlong penalty (rows,: DAPO's, on the response's or the
    episode's length) or None, and the reward function's
    numeric extras {key: (rows,)} (engine/rewards/reward_fn.py) of `out`'s rows, `n` per record; `texts`:
    the rows already decoded (`decode_responses`), else decoded here."""
    alg, max_len = c.cfg.algorithm, max_response_tokens(c.cfg.rollout)
    if texts is None:
        texts = decode_responses(c.tokenizer, out.response_ids, out.response_mask)
    rec = [records[r // n] for r in range(len(texts))]
    infos = [x.extra_info for x in rec]
    if out.episodes is not None:  # multi-turn: the reward also reads the episode's turns and tool results
        infos = [{**info, "turns": episode.turns} for info, episode in zip(infos, out.episodes)]
    scores, extras = torch.zeros(len(texts), dtype=torch.float32), {}
    if c.reward_fn is not None:
        result = c.reward_fn.score([x.data_source for x in rec], texts, [x.ground_truth for x in rec], infos)
        scores, extras = result.scores, result.extras
    if c.reward_model is not None:  # combine=model: alone; combine=sum: added to the rule score
        prompts = [r.prompt_ids for r in records]
        scores = scores + c.reward_model(prompts, out.response_ids, out.response_mask, n, batcher)
    penalty = None
    buffer = overlong_buffer_tokens(alg, max_len)
    if buffer > 0:  # an episode's length counts its tool turns (engine/config_rules.py max_response_tokens)
        lengths = (
            response_lengths(out.response_mask) if out.episodes is not None else out.response_mask.sum(-1)
        )
        penalty = overlong_penalty(
            lengths, max_len=max_len, buffer_len=buffer, penalty_factor=alg.overlong_penalty
        ).to(scores.dtype)
    return scores, penalty, extras


def scored_responses(ctx: StepContext, records, round_index: int) -> Responses:
    """Roll out and score one batch of prompts (with the greedy baseline when the estimator needs one)."""
    c = ctx.c
    greedy = advantage_traits(c.cfg.algorithm.adv_estimator).needs_greedy_baseline
    outs = rollout(ctx, records, ("sample", "greedy") if greedy else ("sample",), round_index)
    with ctx.timer.phase("reward"):
        return responses_of(c, records, outs, ctx.batcher)


def responses_of(
    c: Components, records, outs: list[RolloutOutput], batcher: MicroBatcher | None
) -> Responses:
    """The scored `Responses` of one batch: `outs` are its "sample" rollout and, when the estimator needs a
    greedy baseline, its "greedy" one. `c` needs cfg, tokenizer, reward_fn and reward_model (the rollout
    ranks of split placement pass their worker)."""
    n = c.cfg.rollout.n
    scores, penalty, extras = score(c, outs[0], records, n, batcher)
    baseline = None
    if len(outs) > 1:
        greedy_scores, greedy_penalty, _ = score(c, outs[1], records, 1, batcher)
        if greedy_penalty is not None:
            greedy_scores = greedy_scores + greedy_penalty
        baseline = greedy_scores.repeat_interleave(n)
    out = outs[0]
    return Responses(
        records=list(records),
        n=n,
        response_ids=out.response_ids,
        response_mask=out.response_mask,
        log_probs=out.log_probs,
        routed_experts=out.routed_experts,
        finished=torch.tensor([r == "stop" for r in out.finish_reasons], dtype=torch.float32),
        scores=scores,
        overlong_penalty=penalty,
        baseline_scores=baseline,
        reward_extras=extras,
    )
