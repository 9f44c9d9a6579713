"""The native engine's multi-turn continuations: where each row's K/V sit after a `generate` call inside
`NativeRollout.hold()` (`KeptRows`), and the prefill of a next turn's new tokens against them
(`prefill_continued`). engine/rollout/native.py's module docstring says when rows are kept and when a turn is
prefilled in full."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.rollout.base import RolloutOutput


@dataclass
class KeptRows:
    """The cache rows of the latest `generate` call inside `hold()`, per output row of that call."""

    slot: list[int]
    """Cache slot of the row."""
    pad: list[int]
    """Left padding of the row: its K/V sit at cache positions [pad, pad + valid)."""
    valid: list[int]
    """Tokens whose K/V are written: the prompt and every generated token but the last (never fed back)."""
    tokens: list[list[int]]
    """The row's prompt and response ids (a continuation's prompt must start with them)."""
    slots: int
    seq_len: int
    """The cache layout (slots, seq_len) the rows live in."""


def kept_rows(rows, prompts, result: RolloutOutput, track, slots: int, seq_len: int) -> KeptRows:
    """Where each output row's K/V sit after a one-chunk call: `track` = (chunk row of each slot, -1 for
    none; left padding of each slot)."""
    home, pad = (t.tolist() for t in track)
    num_rows = len(rows)
    kept = KeptRows([-1] * num_rows, [0] * num_rows, [0] * num_rows, [[]] * num_rows, slots, seq_len)
    lengths = result.response_mask.sum(-1).long().tolist()
    for slot, i in enumerate(home):
        if i < 0:
            continue
        r, p = rows[i]
        length = lengths[r]
        kept.slot[r], kept.pad[r] = slot, pad[slot]
        kept.valid[r] = len(prompts[p]) + length - 1  # the last token was never fed back
        kept.tokens[r] = list(prompts[p]) + result.response_ids[r, :length].tolist()
    return kept


def prefill_continued(
    model, pad_id: int, prefill_tokens: int, chunk, prompts, caches, kept: KeptRows, previous: list[int]
):
    """NativeRollout's prefill for prompts that extend kept rows: row j of the chunk (prompt p, kept row previous[p])
    gets that row's K/V moved from its slot into slot j, shifted to this call's left padding (RoPE
    positions count real tokens, so they stay valid), then the tokens past the kept ones are prefilled
    against them. Returns each row's logits (rows, vocab), padding (rows,) and the padded prompt length."""
    dev, n = caches[0][0].device, len(chunk)
    lens = [len(prompts[p]) for _, p in chunk]
    plen = max(lens)
    src = torch.tensor([kept.slot[previous[p]] for _, p in chunk], device=dev)
    old_pad = torch.tensor([kept.pad[previous[p]] for _, p in chunk], device=dev)
    pad_r = torch.tensor([plen - length for length in lens], device=dev)
    # slot j, position t <- slot src[j], position t - pad_r[j] + old_pad[j] (the clamped ends are padding
    # or are overwritten by the prefill below); gathered before written, so slots may swap
    at = (torch.arange(plen, device=dev) - pad_r[:, None] + old_pad[:, None]).clamp(0, kept.seq_len - 1)
    for cache in (*caches[0], *caches[1]):
        cache[:n, :plen] = cache[src[:, None], at]
    valid = [kept.valid[previous[p]] for _, p in chunk]
    width = max(length - v for length, v in zip(lens, valid))
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    real = torch.zeros(n, width, dtype=torch.bool)
    for j, (_, p) in enumerate(chunk):  # the new tokens, right-aligned to end at plen
        tail = prompts[p][valid[j] :]
        ids[j, width - len(tail) :], real[j, width - len(tail) :] = torch.tensor(tail), True
    ids, real = ids.to(dev), real.to(dev)
    logits = torch.empty(n, model.shape.vocab_size, device=dev)
    per = max(1, prefill_tokens // plen)
    for a in range(0, n, per):
        b = min(n, a + per)
        cache_k, cache_v = [k[a:b] for k in caches[0]], [v[a:b] for v in caches[1]]
        logits[a:b] = model.prefill_continued(ids[a:b], real[a:b], pad_r[a:b], plen, cache_k, cache_v)
    return logits, pad_r, plen
