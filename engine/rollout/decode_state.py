"""The native engine's per-call state: the decode slots (`SlotState`, read by the CUDA graphs) and the
step-major outputs of one `generate` call (`CallOutputs`); engine/rollout/native.py fills both, with
`record_tokens` (sample a step's tokens into the outputs) and `compact_slots` (live slots to the front).

Each slot has its own cache position (`cur`) and response step (`step`): a row admitted into a slot freed by
a finished row starts at its own prompt's end while the others go on. Row r's K/V sit at positions
[pad[r], cur[r]); the next decode step writes position cur[r] and attends over [pad[r], cur[r]]. A slot that
is not alive (finished, or filler up to the batch bucket) keeps its position (`cur` advances for live slots
only) and has `pad` = `cur`: it reads one key, writes where nothing valid is, and its outputs go to the
scratch row.

The samples of one prompt admitted together (a "group") hold the same K/V at their prompt's positions
[pad, prefix_end): every slot reads them from the first live slot of its group (`prefix_from`, kept by
`refresh_prefix_from` after every admission, compaction and host check, so that no slot's prompt is read from
a slot that finished: its positions may be overwritten or its pages freed), and its own positions from
prefix_end on (engine/rollout/triton_decode.py's `sourced`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.rollout.kv_cache import compact_rows
from engine.rollout.sampler import sample_tokens


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
    """(slots,) int64: cache position the slot's next decode step writes (advanced for live slots only)."""
    step: torch.Tensor
    """(slots,) int64: response index of the token the slot samples next."""
    group: torch.Tensor
    """(slots,) int64: the slot's prompt group (rows of one prompt admitted together share one), -1: filler."""
    prefix_end: torch.Tensor
    """(slots,) int64: end of the slot's prompt positions (the padded prompt length; 0: filler)."""
    prefix_from: torch.Tensor
    """(slots,) int64: the slot whose copy of this slot's prompt it reads: the first live slot of its group, or
    itself."""
    table: torch.Tensor | None = None
    """(slots, pages per row) int32: the page table of a paged call (engine/rollout/paged_kv.py), else None."""

    @staticmethod
    def reuse(state, slots: int, pages_per_row: int, pad_id: int, device) -> SlotState:
        """`state` where it has `slots` slots (and a page table of `pages_per_row` where that is not 0), else a
        new state of that size (CUDA graphs captured on the old one are then invalid)."""
        if state is not None and state.tokens.numel() == slots:
            if not pages_per_row or (state.table is not None and state.table.shape[1] == pages_per_row):
                return state
        long = torch.long
        return SlotState(
            tokens=torch.full((slots,), pad_id, dtype=long, device=device),
            pad=torch.zeros(slots, dtype=long, device=device),
            row_of=torch.zeros(slots, dtype=long, device=device),
            alive=torch.zeros(slots, dtype=torch.bool, device=device),
            cur=torch.zeros(slots, dtype=long, device=device),
            step=torch.zeros(slots, dtype=long, device=device),
            group=torch.full((slots,), -1, dtype=long, device=device),
            prefix_end=torch.zeros(slots, dtype=long, device=device),
            prefix_from=torch.arange(slots, device=device),
            table=torch.zeros(slots, pages_per_row, dtype=torch.int32, device=device)
            if pages_per_row
            else None,
        )

    def prompt_sources(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(prefix_from, prefix_end) of slots [0, width): engine/rollout/triton_decode.py's `sourced`."""
        return self.prefix_from[:width], self.prefix_end[:width]

    def moved_with_the_slot(self) -> tuple[torch.Tensor, ...]:
        """The per-slot tensors a compaction permutes (`alive` is rebuilt, `prefix_from` refreshed)."""
        return (
            self.tokens,
            self.pad,
            self.row_of,
            self.cur,
            self.step,
            self.group,
            self.prefix_end,
        )

    def set_idle(self, lo: int, hi: int, scratch: int, pad_id: int) -> None:
        """Slots [lo, hi) become fillers: not alive, outputs to the scratch row, reading one key."""
        self.alive[lo:hi], self.row_of[lo:hi], self.tokens[lo:hi] = False, scratch, pad_id
        self.pad[lo:hi] = self.cur[lo:hi]
        self.group[lo:hi], self.prefix_end[lo:hi] = -1, 0
        self.prefix_from[lo:hi] = torch.arange(lo, hi, device=self.group.device)
        if self.table is not None:
            self.table[lo:hi] = 0  # the scratch page

    def admit(self, lo: int, chunk, pad: torch.Tensor, plen: int, starts: list[int], chunk_id: int) -> None:
        """Slots [lo, lo + len(chunk)) take the rows of `chunk` ((output row, prompt) each), prefilled to `plen`
        positions with `pad` padding each, at response steps `starts`; the samples of one prompt in chunk
        number `chunk_id` form one group."""
        hi, dev = lo + len(chunk), self.tokens.device
        self.pad[lo:hi], self.cur[lo:hi], self.alive[lo:hi] = pad, plen, True
        self.prefix_end[lo:hi] = plen
        self.step[lo:hi] = torch.tensor(starts, device=dev)
        self.row_of[lo:hi] = torch.tensor([r for r, _ in chunk], device=dev)
        self.group[lo:hi] = torch.tensor([(chunk_id << 32) + p for _, p in chunk], device=dev)

    def refresh_prefix_from(self, width: int) -> None:
        """Point each of slots [0, width) at the first live slot of its group, itself where there is none (no
        host synchronisation)."""
        group, alive = self.group[:width], self.alive[:width]
        index = torch.arange(width, device=group.device)
        same = (group[:, None] == group[None, :]) & alive[None, :]
        first = torch.where(same, index[None, :], width).amin(1)
        self.prefix_from[:width] = torch.where(first < width, first, index)


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


def record_tokens(
    logits, sampling, gen, stops, out: CallOutputs, st: SlotState, lo: int, pad_id: int, fused: bool = False
) -> None:
    """Sample one token per slot from `logits` (the rows of slots [lo, lo + len(logits))), store the tokens
    of live slots at their own response step, retire the slots that stop (a stop token, their row's limit,
    or `sampling.max_new_tokens` tokens); a retired slot reads one key from then on. `fused`:
    sampler.sample_tokens's."""
    tokens, logp = sample_tokens(logits, sampling, gen, fused)
    hi = lo + logits.shape[0]
    alive, step = st.alive[lo:hi], st.step[lo:hi]
    scratch = out.stopped.numel() - 1
    row = torch.where(alive, st.row_of[lo:hi], scratch)
    at = torch.where(alive, step, 0)
    out.ids.index_put_((at, row), torch.where(alive, tokens, pad_id))
    out.log_probs.index_put_((at, row), torch.where(alive, logp, 0.0))
    out.mask.index_put_((at, row), alive)
    if stops is not None:
        hit = alive & torch.isin(tokens, stops)
        out.stopped.index_put_((row,), out.stopped[row] | hit)
        alive &= ~hit
    limit = out.limit[row] if out.limit is not None else sampling.max_new_tokens
    alive &= limit > step + 1  # the row's last token by its limit: "length"
    st.step[lo:hi] += 1
    st.tokens[lo:hi] = torch.where(alive, tokens, pad_id)
    st.pad[lo:hi] = torch.where(alive, st.pad[lo:hi], st.cur[lo:hi])


def compact_slots(
    caches, st: SlotState, live: int, width: int, top: int, scratch: int, pad_id: int, track=None
) -> None:
    """Move the live slots of [0, width) to [0, live) (K/V positions [0, top): `top` bounds every slot's
    position); slots [live, width) become fillers. With `track` (slot bookkeeping of kept rows), the
    finished slots' K/V move behind the live ones instead of being overwritten, with their state and
    `track` permuted alike."""
    keep = st.alive[:width].nonzero().squeeze(1)
    order = keep if track is None else torch.cat((keep, (~st.alive[:width]).nonzero().squeeze(1)))
    compact_rows(*caches, order, top)
    for buf in (*st.moved_with_the_slot(), *(track or ())):
        buf[: order.numel()] = buf[order]
    st.alive[:live] = True
    st.set_idle(live, width, scratch, pad_id)


def compact_paged(st: SlotState, sched, alive: list[bool], live: int, width: int, scratch: int, pad_id: int):
    """`compact_slots` for a paged call: the live slots of [0, width) (`alive`, read at the host check just
    before, whose finished slots hold no pages) move to [0, live) with their page-table rows; no K/V move."""
    order = [s for s in range(width) if alive[s]] + [s for s in range(width) if not alive[s]]
    index = torch.tensor(order, device=st.tokens.device)
    for buf in st.moved_with_the_slot():
        buf[:width] = buf[index]
    sched.permute(order)
    st.alive[:live] = True
    st.set_idle(live, width, scratch, pad_id)
    st.table[:width].copy_(sched.host[:width])
