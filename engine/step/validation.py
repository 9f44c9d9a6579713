"""Validation metrics per data source, as verl users read them.

Every validation prompt gets one response at `rollout.val_temperature` (greedy by default), logged as
`val/<data_source>/reward` (and over all sources as `val/reward_mean`). With `rollout.val_n=k > 1` it also
gets k responses sampled at `rollout.val_temperature`, `val_top_p` and `val_top_k` (verl's `val_kwargs` with
n = k), or as in training (`rollout.temperature`, `top_p`, `top_k`) where val_temperature is 0, since k
greedy responses would be one; logged per source as:
- `mean@k`: the mean reward of the k responses;
- `best@k`: the best of the k (exact: the maximum over the prompt's k responses; verl estimates it by
  bootstrap over subsets of size k drawn with replacement, which reads lower);
- `maj@k`: the reward of the majority answer: each response's final answer is read as the built-in rule
  compares it (`engine.rewards.rule_answer`: GSM8K's number, the normalised box of boxed math), the most
  frequent answer wins (ties: the one seen first), and the prompt scores what a response with that answer
  scored; when no response has an answer, what they scored (the rule's score of no answer: 0, or -1 for
  math_dapo). Logged only where answers are defined: built-in rules without a reward model scoring alone.
The reward function's numeric extras (engine/rewards/reward_fn.py: DAPO-Math's `acc`) are logged per source
as `extra/<key>` for the one response (verl's `<key>/mean@1`) and, with val_n=k > 1, `extra/<key>/mean@k`
for the k (verl's `<key>/mean@k`); a source whose responses lack a key has none.
All of these are averaged over prompts across every DP replica, each prompt counted once (the repeats that
even out the replicas' shares are run, not counted).

`validate` rolls out and scores every validation batch of the rank and returns these metrics.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from engine.rewards.registry import find_rule, rule_answer
from engine.step.context import StepContext
from engine.step.reward import decode_responses, score
from engine.step.rollout import rollout
from engine.step.stats import dp_stats


def response_answers(
    data_sources: Sequence[str], texts: Sequence[str], gsm8k_method: str
) -> list[str | None] | None:
    """The final answer of each response by the built-in rules (None where a response has none); None when
    some data source's rule defines no answer (then no majority vote is taken)."""
    for source in set(data_sources):
        rule = find_rule(source)
        if rule is None or rule.answer is None:
            return None
    options = {"gsm8k": {"method": gsm8k_method}}
    return [rule_answer(source, text, options) for source, text in zip(data_sources, texts)]


def sample_metrics(scores_pk: torch.Tensor, answers: Sequence[str | None] | None) -> dict[str, torch.Tensor]:
    """mean@k, best@k and (with answers, row-major like scores) maj@k of each prompt; scores_pk (prompts, k)."""
    k = scores_pk.shape[1]
    out = {f"mean@{k}": scores_pk.mean(1), f"best@{k}": scores_pk.max(1).values}
    if answers is None:
        return out
    majority = scores_pk[:, 0].clone()  # no answer in any response: what they scored without one
    for p in range(scores_pk.shape[0]):
        mine = answers[p * k : (p + 1) * k]
        votes = Counter(a for a in mine if a is not None)
        if votes:
            winner = votes.most_common(1)[0][0]  # ties: the answer counted first
            majority[p] = scores_pk[p, mine.index(winner)]
    out[f"maj@{k}"] = majority
    return out


def per_source_means(
    batches: Sequence[tuple[Sequence[str], Mapping[str, torch.Tensor]]], dp_group: dist.ProcessGroup
) -> dict[str, float]:
    """`val/<source>/<name>`: the mean over prompts of every per-prompt value, all DP replicas together; NaN
    values (a reward extra the prompt's responses lack) are left out, and a name with none is not logged.
    `batches`: (data source of each prompt, {name: value per prompt}) for this replica's batches."""
    totals: dict[tuple[str, str], list[float]] = {}
    for sources, values in batches:
        for name, per_prompt in values.items():
            for source, value in zip(sources, per_prompt.tolist()):
                if math.isnan(value):
                    continue
                entry = totals.setdefault((source, name), [0.0, 0.0])
                entry[0] += value
                entry[1] += 1.0
    gathered: list = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(gathered, totals, group=dp_group)
    merged: dict[tuple[str, str], list[float]] = {}
    for replica in gathered:
        for key, (total, count) in replica.items():
            entry = merged.setdefault(key, [0.0, 0.0])
            entry[0] += total
            entry[1] += count
    return {
        f"val/{source}/{name}": total / count for (source, name), (total, count) in sorted(merged.items())
    }


def validation_due(trainer, completed: int) -> bool:
    """Whether validation runs after `completed` steps (trainer.test_freq and the run's last step); the
    trainer and, under split placement, the rollout ranks ask the same."""
    t = trainer
    return bool(t.test_freq) and (completed % t.test_freq == 0 or completed == t.total_steps)


def row_scores(
    c, records, outs: list, batcher
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], list[str | None] | None]:
    """Each rollout's row scores and reward extras ({key: (rows,)}, NaN where a row's output lacked the key)
    (the "val" rollout `outs[0]`, with rollout.val_n=k > 1 the "val_sample" one `outs[1]`, k rows per prompt)
    and the sampled rows' answers for maj@k (None where no majority is taken: reward.fn or a reward model, or
    a rule that defines no answer). `c` needs cfg, tokenizer, reward_fn and reward_model (the rollout ranks
    of split placement pass their worker)."""
    k = c.cfg.rollout.val_n
    first, _, first_extras = score(c, outs[0], records, 1, batcher)
    scores, extras, answers = [first], [first_extras], None
    if k > 1:
        texts = decode_responses(c.tokenizer, outs[1].response_ids, outs[1].response_mask)
        sampled, _, sampled_extras = score(c, outs[1], records, k, batcher, texts)
        scores.append(sampled)
        extras.append(sampled_extras)
        if c.cfg.reward.fn == "" and not c.cfg.reward.model_path:
            sources = [records[i // k].data_source for i in range(len(texts))]
            answers = response_answers(sources, texts, c.cfg.reward.gsm8k_method)
    return scores, extras, answers


def prompt_values(
    k: int,
    scores: list[torch.Tensor],
    extras: list[dict[str, torch.Tensor]],
    answers: list[str | None] | None,
) -> dict[str, torch.Tensor]:
    """{name: value per prompt} from `row_scores`' output: `reward` and `extra/<key>` of the "val" rollout,
    and with rollout.val_n=k > 1 mean@k, best@k (and maj@k) and `extra/<key>/mean@k` of the "val_sample" one
    (NaN for a prompt whose k responses all lack the key)."""
    values = {"reward": scores[0], **{f"extra/{key}": v for key, v in extras[0].items()}}
    if k > 1:
        values.update(sample_metrics(scores[1].view(-1, k), answers))
        values.update({f"extra/{key}/mean@{k}": v.view(-1, k).nanmean(1) for key, v in extras[1].items()})
    return values


def batch_values(c, records, outs: list, batcher) -> dict[str, torch.Tensor]:
    """{name: value per prompt} of one validation batch (`row_scores`, then `prompt_values`)."""
    return prompt_values(c.cfg.rollout.val_n, *row_scores(c, records, outs, batcher))


def scored_prompts(
    per_prompt: list[tuple[Sequence[str], Mapping[str, torch.Tensor]]], keep: int
) -> list[tuple[Sequence[str], Mapping[str, torch.Tensor]]]:
    """The first `keep` prompts of the batches' (data sources, {name: value per prompt}): those after them
    repeat earlier prompts to even out the replicas' shares (engine/setup.py `replica_val_batches`)."""
    out = []
    for sources, values in per_prompt:
        n = min(len(sources), keep)
        if n:
            out.append((sources[:n], {name: v[:n] for name, v in values.items()}))
        keep -= n
    return out


def validate(ctx: StepContext) -> dict[str, float]:
    """`val/*` metrics over every validation batch of this rank (collective over DP); `ctx.timer` times it.
    Under split placement the rollout ranks generate and score the batches (`TrainerLink.validate`)."""
    c, k = ctx.c, ctx.c.cfg.rollout.val_n
    if c.split is not None:
        per_prompt = c.split.validate(ctx)
    else:
        per_prompt = []
        for records in c.val_batches:
            outs = rollout(ctx, records, ("val", "val_sample") if k > 1 else ("val",))
            per_prompt.append(([r.data_source for r in records], batch_values(c, records, outs, ctx.batcher)))
    per_prompt = scored_prompts(per_prompt, c.val_prompts)
    rewards = [values["reward"] for _, values in per_prompt]
    mean, std, _, _ = dp_stats(torch.cat(rewards) if rewards else torch.zeros(0), c.groups)
    return {
        "val/reward_mean": mean,
        "val/reward_std": std,
        **per_source_means(per_prompt, c.groups.dp),
        "timing/testing": sum(ctx.timer.seconds.values()),
    }
