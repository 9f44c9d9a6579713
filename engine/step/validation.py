"""Validation rewards (engine/validation.py's metrics): at rollout.val_temperature, overall and per data
source, and with rollout.val_n = k > 1 mean@k, best@k and maj@k of k sampled responses per prompt."""

from __future__ import annotations

import torch

from engine.step.context import StepContext
from engine.step.reward import score
from engine.step.rollout import rollout
from engine.step.stats import dp_stats
from engine.validation import decode_responses, per_source_means, response_answers, sample_metrics


def validate(ctx: StepContext) -> dict[str, float]:
    """`val/*` metrics over every validation batch of this rank (collective over DP); `ctx.timer` times it."""
    c, k = ctx.c, ctx.c.cfg.rollout.val_n
    scores, per_prompt = [], []
    for records in c.val_batches:
        outs = rollout(ctx, records, ("val", "val_sample") if k > 1 else ("val",))
        values = {"reward": score(c, outs[0], records, 1, ctx.batcher)[0]}
        scores.append(values["reward"])
        if k > 1:
            sampled = score(c, outs[1], records, k, ctx.batcher)[0]
            answers = None
            if c.cfg.reward.fn == "" and c.reward_model is None:
                texts = decode_responses(c.tokenizer, outs[1].response_ids, outs[1].response_mask)
                sources = [records[i // k].data_source for i in range(len(texts))]
                answers = response_answers(sources, texts, c.cfg.reward.gsm8k_method)
            values.update(sample_metrics(sampled.view(len(records), k), answers))
        per_prompt.append(([r.data_source for r in records], values))
    mean, std, _, _ = dp_stats(torch.cat(scores), c.groups)
    return {
        "val/reward_mean": mean,
        "val/reward_std": std,
        **per_source_means(per_prompt, c.groups.dp),
        "timing/testing": sum(ctx.timer.seconds.values()),
    }
