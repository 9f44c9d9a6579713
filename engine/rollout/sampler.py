"""Token sampling from full-vocabulary logits: temperature, top-k, top-p, greedy; seeded."""

from __future__ import annotations

import torch

from engine.rollout.base import SamplingParams


def sample_tokens(
    logits_bv: torch.Tensor, sampling: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens (b,), log-prob of each under softmax(logits / T)).

    The returned log-prob ignores top-k/top-p truncation on purpose: it is what the actor's training
    forward computes for the same token, so the two can be compared and used for importance weights.
    """
    logits = logits_bv.float()
    if sampling.temperature == 0.0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / sampling.temperature
    logp_full = torch.log_softmax(scaled, -1)
    filtered = scaled
    if sampling.top_k > 0 and sampling.top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, sampling.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = filtered.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (
            cum - sorted_logits.softmax(-1) >= sampling.top_p
        )  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    probs = filtered.softmax(-1)
    tokens = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return tokens, logp_full.gather(-1, tokens[:, None]).squeeze(-1)
