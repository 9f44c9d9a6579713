"""Token sampling from full-vocabulary logits: greedy, temperature, top-k, top-p; seeded by a torch.Generator.

The returned log-prob is always that of the drawn token under softmax(logits / temperature) over the FULL
vocabulary (temperature 1 when greedy): what the actor's training forward computes for the same token, so
the two can be compared and used for importance weights. Top-k/top-p only restrict which tokens are drawn,
as transformers' warpers and vLLM do: top-k first (tokens tied with the k-th largest logit stay), then the
smallest prefix of the rest, by probability, that reaches top-p.

Draws use the inverse CDF with one uniform number per row (`_draw`): on CPU `torch.multinomial` (and the
exponential race) spend ~1 ms per decode step on a (64, 512) batch, more than the model; this takes ~0.08 ms.
The CDF is taken in two levels (sums of 256-token blocks, then inside the one block drawn): a cumulative sum
over a 152k vocabulary is a slow scan on GPU (0.6 ms per decode step at 512 rows on an H200, ~2.5% of a 7B
rollout), block sums are one reduction. On CUDA the softmax statistics (upcast, temperature, log-sum-exp,
probabilities) run as compiled kernels (ENGINE_COMPILE_ROLLOUT=0: eager). With `fused` (the engine's
`DecodeKernels.sampler`) and neither top-k nor top-p, the draw is instead the same two-level inverse CDF in two
Triton kernels that read each logit once in the model's dtype (engine/rollout/triton_sample.py): the same
distribution, other random numbers (one per level).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.compiled import ROLLOUT, cuda_kernel, switched_on
from engine.rollout import triton_sample
from engine.rollout.base import SamplingParams

BLOCK = 256
"""Tokens per block of the two-level inverse CDF."""


def _drop_beyond_top_p(sorted_bk: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits sorted descending (b, k) -> the same with every token past the smallest prefix whose
    probability mass reaches `top_p` set to -inf (the most likely token always stays)."""
    probs = sorted_bk.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    return sorted_bk.masked_fill(mass_before >= top_p, float("-inf"))


def _draw(weights_bk: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One index per row with probability proportional to `weights_bk` (b, k) >= 0: the first index whose
    cumulative weight reaches u * total, u uniform in (0, 1] (so zero-weight entries are never drawn).
    Two levels: the block whose cumulative block sum reaches the target, then the index inside it whose
    cumulative weight reaches what is left (kept within the block's positive mass against rounding)."""
    b, k = weights_bk.shape
    u = 1.0 - torch.rand(b, 1, generator=gen, device=weights_bk.device)
    nb = -(-k // BLOCK)
    blocks = F.pad(weights_bk, (0, nb * BLOCK - k)).view(b, nb, BLOCK)  # zero tail weights: never drawn
    sums = blocks.sum(-1)  # (b, nb)
    cdf = sums.cumsum(-1)
    target = u * cdf[:, -1:]  # (b, 1)
    j = torch.searchsorted(cdf, target).clamp_(max=nb - 1)
    inner = blocks.gather(1, j[:, :, None].expand(b, 1, BLOCK)).squeeze(1).cumsum(-1)  # (b, BLOCK)
    rest = target - (cdf.gather(1, j) - sums.gather(1, j))
    rest = torch.minimum(rest.clamp(min=torch.finfo(rest.dtype).tiny), inner[:, -1:])
    i = torch.searchsorted(inner, rest).clamp_(max=BLOCK - 1)
    return (j * BLOCK + i).squeeze(-1)


def _scaled_lse(logits: torch.Tensor, inv_temperature: float):
    """float32 logits / temperature (as a product, like the training forward) and their log-sum-exp per row."""
    scaled = logits.float() * inv_temperature
    return scaled, torch.logsumexp(scaled, -1)


def _scaled_lse_probs(logits: torch.Tensor, inv_temperature: float):
    """`_scaled_lse` and the softmax probabilities."""
    scaled, lse = _scaled_lse(logits, inv_temperature)
    return scaled, lse, (scaled - lse[:, None]).exp()


def fused_draw(logits_bv: torch.Tensor, sampling: SamplingParams) -> bool:
    """The Triton draw applies: temperature sampling without top-k/top-p, on logits its kernels take, and the
    rollout's kernels switched on (ENGINE_COMPILE_ROLLOUT)."""
    plain = (
        sampling.temperature > 0.0 and not 0 < sampling.top_k < logits_bv.shape[-1] and sampling.top_p >= 1.0
    )
    return plain and triton_sample.supported(logits_bv) and switched_on(ROLLOUT)


def sample_tokens(
    logits_bv: torch.Tensor, sampling: SamplingParams, gen: torch.Generator, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits_bv` (b, vocab) (any float dtype); return (tokens (b,) int64, log-probs
    (b,) float32). `fused`: the Triton draw where `fused_draw` says it applies."""
    if fused and fused_draw(logits_bv, sampling):
        return triton_sample.sample(logits_bv, 1.0 / sampling.temperature, gen)
    if sampling.temperature == 0.0:
        logits = logits_bv.float()
        tokens = logits.argmax(-1)
        logp = logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        return tokens, logp
    top_k = sampling.top_k if 0 < sampling.top_k < logits_bv.shape[-1] else 0
    restricted = bool(top_k) or sampling.top_p < 1.0
    stats = cuda_kernel(
        _scaled_lse if restricted else _scaled_lse_probs, logits_bv.device, ROLLOUT, dynamic=None
    )
    scaled, lse, *probs = stats(logits_bv, 1.0 / sampling.temperature)
    if restricted:
        candidates = scaled
        if top_k:  # tokens below the k-th largest logit go; ties with it stay (as transformers and vLLM)
            kth = scaled.topk(top_k, dim=-1).values[:, -1:]
            candidates = scaled.masked_fill(scaled < kth, float("-inf"))
        if sampling.top_p < 1.0:  # the top-p cut needs the candidates sorted
            values, index = candidates.sort(dim=-1, descending=True)
            values = _drop_beyond_top_p(values, sampling.top_p)
            tokens = index.gather(-1, _draw(values.softmax(-1), gen)[:, None]).squeeze(-1)
        else:
            tokens = _draw(candidates.softmax(-1), gen)
    else:
        tokens = _draw(probs[0], gen)
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse
