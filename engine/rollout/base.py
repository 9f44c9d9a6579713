"""The one interface every rollout backend implements, and its inputs and outputs.

Prompts go in as lists of token ids (no padding: each backend pads its own way). Responses come back
right-padded with `pad_id`, one row per (prompt, sample) with the n samples of a prompt adjacent:
row i belongs to prompt i // n.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; one instance per rollout call."""

    n: int = 1
    """Responses per prompt."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    max_new_tokens: int = 16
    """Most tokens per response."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a response ends after any of these (EOS included here)."""
    ignore_eos: bool = False
    """Keep going past stop tokens (fixed-length benchmarks)."""
    seed: int = 0
    """Seed of the sampler; same seed and inputs give the same responses."""


@dataclass
class RolloutOutput:
    """Responses of one rollout call, (num_prompts * n) rows."""

    response_ids: torch.Tensor
    """(rows, max_new_tokens) int64, right-padded with pad_id."""
    response_mask: torch.Tensor
    """(rows, max_new_tokens) float32, 1 for generated tokens (a final stop token included)."""
    log_probs: torch.Tensor
    """(rows, max_new_tokens) float32: log-prob of each sampled token under softmax(logits / temperature)
    of the full vocabulary (temperature 1 when greedy), i.e. what the actor's training forward computes;
    top-k/top-p only restrict which tokens are drawn. 0 on padding."""
    finish_reasons: list[str] = field(default_factory=list)
    """Per row: "stop" (a stop token was generated) or "length"."""


class RolloutEngine:
    """Generates responses; implementations: engine/rollout/native.py, engine/rollout/vllm_backend.py."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        raise NotImplementedError


def check_prompts(prompts: list[list[int]], max_len: int, vocab_size: int) -> None:
    """Empty, overlong or out-of-vocabulary prompts are errors naming the prompt index and the fix."""
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
