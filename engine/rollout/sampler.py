"""Token sampling from full-vocabulary logits: greedy, temperature, top-k, top-p; seeded by a torch.Generator.

The returned log-prob is always that of the drawn token under softmax(logits / temperature) over the FULL
vocabulary (temperature 1 when greedy): what the actor's training forward computes for the same token, so
the two can be compared and used for importance weights. Top-k/top-p only restrict which tokens are drawn.
"""

from __future__ import annotations

import torch

from engine.rollout.base import SamplingParams


def _drop_beyond_top_p(sorted_bk: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits sorted descending (b, k) -> the same with every token past the smallest prefix whose
    probability mass reaches `top_p` set to -inf (the most likely token always stays)."""
    probs = sorted_bk.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    return sorted_bk.masked_fill(mass_before >= top_p, float("-inf"))


def sample_tokens(
    logits_bv: torch.Tensor, sampling: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits_bv` (b, vocab); return (tokens (b,) int64, log-probs (b,) float32)."""
    logits = logits_bv.float()
    if sampling.temperature == 0.0:
        tokens = logits.argmax(-1)
        logp = logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        return tokens, logp
    scaled = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    lse = torch.logsumexp(scaled, -1)  # (b,)
    top_k = sampling.top_k if 0 < sampling.top_k < scaled.shape[-1] else 0
    if top_k or sampling.top_p < 1.0:
        # restrict to a sorted candidate set: the k best (topk sorts them), else the whole sorted vocabulary
        values, index = scaled.topk(top_k, dim=-1) if top_k else scaled.sort(dim=-1, descending=True)
        if sampling.top_p < 1.0:
            values = _drop_beyond_top_p(values, sampling.top_p)
        choice = torch.multinomial(values.softmax(-1), 1, generator=gen)  # (b, 1)
        tokens = index.gather(-1, choice).squeeze(-1)
    else:
        tokens = torch.multinomial((scaled - lse[:, None]).exp_(), 1, generator=gen).squeeze(-1)
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse
