"""The native engine's per-call state: the decode slots (`SlotState`, read by the CUDA graphs) and the
step-major outputs of one `generate` call (`CallOutputs`); engine/rollout/native.py fills both."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SlotState:
    """Per-slot decode state (preallocated, `slots` long; the CUDA graphs read the first `bucket` entries)."""

    tokens: torch.Tensor
    """(slots,) int64: the token each slot feeds to the next decode step."""
    pad: torch.Tensor
    """(slots,) int64: left-padding positions of the slot's prompt."""
    row_of: torch.Tensor
    """(slots,) int64: output row of the slot (the scratch row for filler slots)."""
    alive: torch.Tensor
    """(slots,) bool: still generating."""
    cur: torch.Tensor
    """(1,) int64: cache position of the next decode step."""


@dataclass
class CallOutputs:
    """Step-major outputs of one generate call, plus a scratch row (index `rows`) for filler slots."""

    ids: torch.Tensor
    """(max_new_tokens, rows + 1) int64."""
    log_probs: torch.Tensor
    """(max_new_tokens, rows + 1) float32."""
    mask: torch.Tensor
    """(max_new_tokens, rows + 1) bool."""
    stopped: torch.Tensor
    """(rows + 1,) bool: a stop token was generated."""
    limit: torch.Tensor | None = None
    """(rows + 1,) int64: each row's most tokens (SamplingParams.max_new_tokens_per_prompt), None: no per-row
    limits."""
