"""The native engine's prefill of newly admitted rows (engine/rollout/native.py): each distinct prompt of the
chunk once, left-padded, at most `prefill_tokens` tokens per forward, its K/V written to the cache rows of its
samples (contiguous rows, or pages through a page table: engine/rollout/paged_kv.py)."""

from __future__ import annotations

import torch

from engine.rollout.paged_kv import positions_at


def prefill_rows(
    model, pad_id: int, prefill_tokens: int, chunk, prompts, caches, recorder=None, table=None, page: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prefill `chunk`'s rows ((output row, prompt index) each, a prompt's samples adjacent) into the cache rows
    of `caches` (per-layer K and V lists: (rows, positions, groups, dim) views of the chunk's slots; paged:
    the flat buffers, with the chunk's page-table rows `table`); returns the logits of each row (rows, vocab),
    each row's padding (rows,) and the padded prompt length."""
    dev = model.embed_w.device
    uniq: list[int] = []
    row_prompt: list[int] = []
    first_row: list[int] = []
    for r, (_, p) in enumerate(chunk):
        if not uniq or uniq[-1] != p:
            uniq.append(p)
            first_row.append(r)
        row_prompt.append(len(uniq) - 1)
    first_row.append(len(chunk))
    plen = max(len(prompts[p]) for p in uniq)
    ids = torch.full((len(uniq), plen), pad_id, dtype=torch.long)
    for u, p in enumerate(uniq):
        ids[u, plen - len(prompts[p]) :] = torch.tensor(prompts[p])
    ids = ids.to(dev)
    pad_u = torch.tensor([plen - len(prompts[p]) for p in uniq], device=dev)
    row_prompt_t = torch.tensor(row_prompt, device=dev)
    cache_k, cache_v = caches
    at = None if table is None else positions_at(table, plen, page)
    logits_u = torch.empty(len(uniq), model.shape.vocab_size, device=dev)
    per = max(1, prefill_tokens // plen)
    for a in range(0, len(uniq), per):
        b = min(len(uniq), a + per)
        r0, r1 = first_row[a], first_row[b]
        if at is None:
            rows_k, rows_v, rows_at = [k[r0:r1] for k in cache_k], [v[r0:r1] for v in cache_v], None
        else:
            rows_k, rows_v, rows_at = cache_k, cache_v, at[r0:r1]
        logits_u[a:b] = model.prefill(ids[a:b], pad_u[a:b], rows_k, rows_v, row_prompt_t[r0:r1] - a, rows_at)
        if recorder is not None:
            recorder.prefill(chunk, uniq, first_row, a, b, prompts)
    return logits_u[row_prompt_t], pad_u[row_prompt_t], plen
