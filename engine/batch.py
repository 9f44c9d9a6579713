"""One step's experience on a training DP replica, and how it is cut into micro-batches.

Sequences are laid out right-padded from position 0: [prompt, response, pad...], so a causal mask alone is
exact for every valid token (no attention mask, no position shifts). Response-aligned tensors (b, T) index
response token j of row r; its log-prob comes from the logits at sequence position prompt_len[r] + j - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Experience:
    """Rows = (prompts of this DP replica) x n, the n samples of a prompt adjacent."""

    tokens: torch.Tensor
    """(rows, seq) int64: prompt + response, right-padded."""
    prompt_lens: torch.Tensor
    """(rows,) int64."""
    response_ids: torch.Tensor
    """(rows, T) int64, right-padded."""
    response_mask: torch.Tensor
    """(rows, T) float32."""
    rollout_log_probs: torch.Tensor
    """(rows, T) float32, from the rollout engine."""
    group_index: torch.Tensor
    """(rows,) int64: global prompt id of each row (GRPO groups)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-row or response-aligned tensors added by later phases (scores, advantages, old/ref log-probs)."""

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def response_index(self) -> torch.Tensor:
        """(rows, T) position in `tokens` of the logits that predict each response token."""
        steps = torch.arange(self.response_ids.shape[1], device=self.tokens.device)
        return (self.prompt_lens[:, None] - 1 + steps).clamp(max=self.tokens.shape[1] - 2)


def build_experience(
    prompts: list[list[int]],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    group_ids: list[int],
    n: int,
    pad_id: int,
    seq_multiple: int = 1,
) -> Experience:
    """Assemble right-padded sequences; `seq_multiple` rounds the length up (TP with sequence parallelism)."""
    rows = response_ids.shape[0]
    lengths = response_mask.sum(-1).long()
    prompt_lens = torch.tensor([len(prompts[r // n]) for r in range(rows)], dtype=torch.long)
    seq = int((prompt_lens + lengths).max()) + 1  # +1: the last valid position still has a target slot
    seq = -(-seq // seq_multiple) * seq_multiple
    tokens = torch.full((rows, seq), pad_id, dtype=torch.long)
    for r in range(rows):
        p, length = int(prompt_lens[r]), int(lengths[r])
        tokens[r, :p] = torch.tensor(prompts[r // n])
        tokens[r, p : p + length] = response_ids[r, :length]
    group = torch.tensor([group_ids[r // n] for r in range(rows)], dtype=torch.long)
    return Experience(tokens, prompt_lens, response_ids, response_mask, rollout_log_probs, group)


def micro_batches(
    exp: Experience, rows: torch.Tensor, size: int, keys: tuple[str, ...], device: torch.device
) -> list[dict]:
    """Dicts of `size` rows each (from the row indices `rows`) with tokens, positions, the response index,
    the response mask and the named per-row/response-aligned tensors, all on `device`."""
    out = []
    index_bt = exp.response_index()
    for start in range(0, len(rows), size):
        sel = rows[start : start + size]
        tokens = exp.tokens[sel]
        mb = {
            "tokens": tokens.to(device),
            "positions": torch.arange(tokens.shape[1]).expand_as(tokens).to(device),
            "response_index": index_bt[sel].to(device),
            "response_mask": exp.response_mask[sel].to(device),
            "rows": sel,
        }
        for key in keys:
            mb[key] = exp.tensors[key][sel].to(device)
        out.append(mb)
    return out
