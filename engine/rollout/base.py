"""The one interface every rollout backend implements, and its inputs and outputs.

Padding contract:
- in: prompts are lists of token ids, unpadded and of any lengths (each backend pads its own way: the native
  engine left-pads inside a batch, vLLM pads nothing);
- out: one row per (prompt, sample), the n samples of a prompt adjacent (row i belongs to prompt i // n),
  `max_new_tokens` columns, right-padded with the engine's `pad_id` (log-prob 0, mask 0 on padding). Output
  tensors are on the CPU whatever device generated them.

Log-prob contract: with `SamplingParams.log_probs` true every backend returns `RolloutOutput.log_probs`; with
it false the caller does not need them and a backend may skip them (vLLM does: they cost it ~40% of its
tokens/s) and return None, or return them anyway (the native engine does: they fall out of its sampler).
Callers that asked for none must not read them; engine/step/rollout.py drops them, so whether a step has
rollout log-probs follows `rollout.log_probs`, not the backend.

Backends: engine/rollout/native.py (`rollout.backend=native`), engine/rollout/vllm_backend.py (`vllm`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

MIN_TEMPERATURE = 0.01
"""The smallest positive sampling temperature. The sampler multiplies float32 logits by 1 / temperature: far
below this bound the product overflows to inf (at 1e-40, 1 / T is itself past float32's 3.4e38) and the softmax
turns NaN; vLLM raises any temperature under 0.01 to 0.01, so the training forward would score other
log-probs than the rollout drew with. Under it sampling is greedy in all but name (a logit gap of 0.1 is a
factor of e^10); temperature 0 is greedy."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; one instance per rollout call."""

    n: int = 1
    """Responses per prompt."""
    temperature: float = 1.0
    """0 = greedy, else >= `MIN_TEMPERATURE`."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    max_new_tokens: int = 16
    """Most tokens per response."""
    max_new_tokens_per_prompt: tuple[int, ...] = ()
    """Optional per-prompt limits, one per prompt, each in [1, max_new_tokens]: the prompt's n responses stop
    there ("length") as vLLM's per-request max_tokens does; empty = max_new_tokens for every prompt.
    Benchmarks draw long-tailed lengths this way (with ignore_eos); outputs stay max_new_tokens wide."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a response ends after any of these (EOS included here)."""
    ignore_eos: bool = False
    """Keep going past stop tokens (fixed-length benchmarks)."""
    seed: int = 0
    """Seed of the sampler; same seed and inputs give the same responses (on the same backend and device)."""
    log_probs: bool = True
    """Return the sampled tokens' log-probs (false: the backend may skip them; module docstring)."""
    routed_experts: bool = False
    """MoE: return the experts the routers chose for every prompt and response token (`RolloutOutput.
    routed_experts`; the native backend only)."""

    def limit_of(self, prompt: int) -> int:
        """The most tokens prompt `prompt`'s responses may have."""
        return (
            self.max_new_tokens_per_prompt[prompt] if self.max_new_tokens_per_prompt else self.max_new_tokens
        )


@dataclass
class RolloutOutput:
    """Responses of one rollout call, (num_prompts * n) rows."""

    response_ids: torch.Tensor
    """(rows, max_new_tokens) int64, right-padded with pad_id."""
    response_mask: torch.Tensor
    """(rows, max_new_tokens) float32, 1 for generated tokens (a final stop token included)."""
    log_probs: torch.Tensor | None
    """(rows, max_new_tokens) float32: log-prob of each sampled token under softmax(logits / temperature)
    of the full vocabulary (temperature 1 when greedy), i.e. what the actor's training forward computes;
    top-k/top-p only restrict which tokens are drawn. 0 on padding. May be None when
    `SamplingParams.log_probs` was false (module docstring)."""
    finish_reasons: list[str] = field(default_factory=list)
    """Per row: "stop" (a stop token was generated) or "length"."""
    episodes: list | None = None
    """Multi-turn rollouts only (engine/multi_turn/episode.py): one `Episode` per row (its turns as text, tool
    calls); `response_mask` is then 0 on tool tokens inside the response as well as on padding."""
    routed_experts: torch.Tensor | None = None
    """With `SamplingParams.routed_experts` (MoE): (rows, longest prompt + max_new_tokens, layers, top_k) int16,
    row r's position i the experts chosen at sequence position i of [prompt, response] (the prompt's from the
    prefill, response token j's from the decode step that fed it); -1 where nothing was routed (padding, the
    last response token). engine/rollout/routes.py."""


class RolloutEngine:
    """Generates responses; implementations: engine/rollout/native.py, engine/rollout/vllm_backend.py.

    Call `set_weights` after every train -> rollout weight transition, then `generate` (the weights must stay
    valid until it returns); `release` frees what the engine holds between rollouts (KV cache, graphs).
    """

    last_stats: dict[str, float]
    """Statistics of the latest `generate` call, backend-specific keys (seconds end in `_s`); the trainer logs
    them as `rollout_engine/<key>`."""

    def set_weights(self, weights) -> None:
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        raise NotImplementedError

    def release(self) -> None:
        """Free memory held between rollouts (no-op by default)."""

    def generate_continued(
        self, prompts: list[list[int]], sampling: SamplingParams, previous: list[int]
    ) -> RolloutOutput:
        """`generate`, where prompt i extends row `previous[i]` of the latest call inside `hold()`: that row's
        prompt and response, then new tokens (the next turn of an episode). Engines that keep a row's KV cache
        (native) prefill only the new tokens; by default the prompts are generated from as they are."""
        return self.generate(prompts, sampling)

    @contextmanager
    def hold(self, max_len: int | None = None):
        """Keep what the engine holds (weights loaded, KV cache, prefix cache) across the `generate` calls made
        inside, e.g. the turns of multi-turn episodes; released on exit. `max_len`: the longest prompt +
        response a call inside needs (a hint for engines that size their cache once). No-op by default."""
        yield


def check_sampling(sampling: SamplingParams) -> None:
    """Refuse sampling parameters no backend can honour, naming the field and the fix."""
    rules = (
        ("n", sampling.n >= 1, "must be >= 1"),
        ("max_new_tokens", sampling.max_new_tokens >= 1, "must be >= 1"),
        (
            "temperature",
            sampling.temperature == 0.0 or sampling.temperature >= MIN_TEMPERATURE,
            f"must be 0 (greedy) or >= {MIN_TEMPERATURE} (MIN_TEMPERATURE)",
        ),
        ("top_p", 0.0 < sampling.top_p <= 1.0, "must lie in (0, 1] (1 = off)"),
        ("top_k", sampling.top_k >= 0, "must be >= 0 (0 = off)"),
    )
    for name, ok, rule in rules:
        if not ok:
            raise ValueError(f"SamplingParams.{name}={getattr(sampling, name)!r} {rule} (rollout.{name})")
    limits = sampling.max_new_tokens_per_prompt
    if limits and not all(1 <= x <= sampling.max_new_tokens for x in limits):
        raise ValueError(
            f"SamplingParams.max_new_tokens_per_prompt must lie in [1, max_new_tokens={sampling.max_new_tokens}], "
            f"got {min(limits)}..{max(limits)}"
        )


def check_limits_match(prompts: list[list[int]], sampling: SamplingParams) -> None:
    """Per-prompt limits, when given, are one per prompt."""
    limits = sampling.max_new_tokens_per_prompt
    if limits and len(limits) != len(prompts):
        raise ValueError(
            f"SamplingParams.max_new_tokens_per_prompt has {len(limits)} limits for {len(prompts)} prompts"
        )


def check_prompts(prompts: list[list[int]], max_len: int, vocab_size: int) -> None:
    """Empty, overlong or out-of-vocabulary prompts are errors naming the prompt index and the fix.

    `max_len` is the longest prompt that fits: max_position_embeddings - max_new_tokens."""
    if max_len < 1:
        raise ValueError(
            f"rollout.max_new_tokens leaves no room for a prompt within model.max_position_embeddings "
            f"({max_len} tokens left); lower rollout.max_new_tokens"
        )
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty; drop it from the batch (the data loader filters them)")
        if len(ids) > max_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, more than the {max_len} that fit with max_new_tokens within "
                "model.max_position_embeddings; lower data.max_prompt_len or rollout.max_new_tokens"
            )
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
