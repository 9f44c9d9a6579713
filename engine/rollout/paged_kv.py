"""Paged KV for the native engine's calls whose rows finish at different times (stop tokens, per-row limits):
each layer's cache is one flat buffer of `page`-position pages, and a slot's row owns the pages its written
positions need, listed in the slot's row of a page table (engine/rollout/decode_state.py `SlotState.table`;
the forward reads position n of row r at `table[r, n // page] * page + n % page`: engine/rollout/model.py).

Why: with one contiguous region per slot, every slot reserves the longest row's positions (prompt + max
tokens), so the KV budget bounds the batch by the longest row while most rows finish far earlier. Here a row
holds only what it has written, plus one check interval ahead, so the batch is bounded by the tokens actually
held (what vLLM's paged cache does). Nothing is reserved from per-row limits: a row that stops at a stop
token costs the same as one cut by its limit.

The host owns the bookkeeping (`PagedSlots`), and it changes only at the engine's host checks (every
`check_every` decode steps, where the host reads every slot's state anyway):
- a finished slot's pages are freed at once (its table row points at the scratch page 0, where it may go on
  writing: a finished slot reads and writes one position until the batch is compacted);
- every live slot grows to cover the positions the next `check_every` steps write;
- when the free pages cannot cover that, the latest admitted rows are preempted (vLLM's recompute policy):
  their pages are freed and they go back to the front of the queue with their response so far, which is
  prefilled as part of their prompt when they are admitted again (`Pending.start` tokens already generated);
- rows are admitted while the free pages cover their prompts and the next interval, keeping one page per
  live row and a 1/32 watermark in hand, so that growth rarely has to preempt.
Compacting the batch permutes table rows, never K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCRATCH_PAGE = 0
"""The page that free table entries point at: written by finished and filler slots, read by nothing live."""


@dataclass
class Pending:
    """A row waiting for a slot."""

    row: int
    """Output row."""
    prompt: int
    """Index of its prompt in the call's prompt list (a preempted row's prompt and response so far are
    appended to that list)."""
    start: int = 0
    """Response tokens it already has (preempted rows)."""


class PagedSlots:
    """Which pages each slot owns (`host`: the page table as the device should hold it), the free pages, and
    each slot's queue entry and admission order."""

    def __init__(self, num_pages: int, page: int, slots: int, seq_len: int):
        pages_per_row = -(-seq_len // page)
        if num_pages - 1 < pages_per_row:
            raise ValueError(f"{num_pages - 1} KV pages cannot hold one row of {pages_per_row} pages")
        self.page, self.pages_per_row, self.num_pages = page, pages_per_row, num_pages
        self.seq_len = seq_len
        """Most positions of a row (the forward reads no further; a row of pages may hold a few more)."""
        self.free = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() takes the lowest page
        self.owned: list[list[int]] = [[] for _ in range(slots)]
        self.host = torch.zeros(slots, pages_per_row, dtype=torch.int32)
        self.entry: list[Pending | None] = [None] * slots
        self.stamp = [0] * slots
        self._clock = 0
        self.preemptions = 0
        self.peak_pages = 0

    @classmethod
    def for_budget(cls, positions: int, page: int, slots: int, seq_len: int) -> PagedSlots | None:
        """As many pages as a budget of `positions` holds, at most what `slots` whole rows of `seq_len`
        positions need with the admission's margins (a growth page per row, the watermark: `fit`), so that
        where the budget allows, rows are admitted as they would be without pages; None where the budget
        cannot hold one whole row."""
        per_row, budget = -(-seq_len // page), positions // page
        if budget - 1 < per_row:  # (page 0 is the scratch page)
            return None
        whole = slots * (per_row + 1)
        return cls(min(budget, whole + whole // 31 + 2), page, slots, seq_len)

    def admissible(self, queue: list[Pending], prompts, sampling, slots: int, live: int, horizon: int) -> int:
        """How many queued rows to admit now: as many as `fit`, if that is at least an eighth of the slots
        (or what is left), so that admissions (each a prefill) stay few; any that fit when nothing is live."""

        def lengths(e: Pending) -> tuple[int, int]:
            return len(prompts[e.prompt]), sampling.limit_of(e.row // sampling.n) - e.start

        k = self.fit(queue, lengths, slots - live, live, horizon)
        return k if live == 0 or k >= min(-(-slots // 8), len(queue)) else 0

    def pages_for(self, positions: int) -> int:
        return min(-(-positions // self.page), self.pages_per_row)

    def watermark(self) -> int:
        return (self.num_pages - 1) // 32

    def release(self, lo: int, hi: int) -> None:
        """Free the pages of slots [lo, hi) (their table rows point at the scratch page)."""
        for s in range(lo, hi):
            self.release_owned(s)
            self.entry[s] = None

    def grow(self, slot: int, positions: int) -> None:
        """Give `slot` the pages of its first `positions` positions (the caller checked that they are free)."""
        have = self.owned[slot]
        for j in range(len(have), self.pages_for(positions)):
            have.append(self.free.pop())
            self.host[slot, j] = have[-1]
        self.peak_pages = max(self.peak_pages, self.num_pages - 1 - len(self.free))

    def fit(self, queue: list[Pending], lengths, free_slots: int, live: int, horizon: int) -> int:
        """How many rows at the head of `queue` (at most `free_slots`) to admit now. `lengths(entry)` = (prompt
        length, response tokens left). Their prompts, padded to the longest of them, the next `horizon`
        positions and a page to grow into (at most a whole row) each fit the free pages with one page per
        live row and the watermark left (none left when nothing is live: the first row always fits); and
        every row's prompt padding and tokens left fit `seq_len` (a preempted row's prompt holds its
        response so far)."""
        keep = live + (self.watermark() if live else 0)
        k = plen = left = 0
        for entry in queue[:free_slots]:
            prompt, tokens = lengths(entry)
            longest, most = max(plen, prompt), max(left, tokens)
            row = min(self.pages_for(longest + horizon + 1) + 1, self.pages_per_row)  # and a growth page
            fits = (k + 1) * row + keep <= len(self.free) and longest + most <= self.seq_len
            if not fits and (k or live):
                break
            k, plen, left = k + 1, longest, most
        return k

    def admit(self, lo: int, entries: list[Pending], positions: int) -> None:
        """Slots [lo, lo + len(entries)) take `entries`, each with pages for its first `positions` positions."""
        for s, entry in enumerate(entries, lo):
            self._clock += 1
            self.entry[s], self.stamp[s] = entry, self._clock
            self.grow(s, positions)

    def check(self, alive: list[bool], cur: list[int], horizon: int) -> list[int]:
        """At a host check of slots [0, len(alive)): free the finished slots' pages, then grow every live slot to
        cover positions [0, cur + horizon]; returns the live slots preempted (latest admitted first) where
        the free pages could not cover that (their pages are freed)."""
        width = len(alive)
        for s in range(width):
            if not alive[s] and self.owned[s]:
                self.release(s, s + 1)
        live = [s for s in range(width) if alive[s]]
        need = {s: self.pages_for(cur[s] + horizon + 1) - len(self.owned[s]) for s in live}
        short = sum(need.values()) - len(self.free)
        preempted = []
        for s in sorted(live, key=lambda s: -self.stamp[s]):
            if short <= 0 or len(preempted) == len(live) - 1:  # the oldest row always fits alone
                break
            short -= need.pop(s) + len(self.owned[s])
            preempted.append(s)
            self.release_owned(s)
        for s in need:
            self.grow(s, cur[s] + horizon + 1)
        self.preemptions += len(preempted)
        return preempted

    def stats(self) -> dict[str, int]:
        return {
            "kv_pages": self.num_pages - 1,
            "kv_peak_pages": self.peak_pages,
            "preemptions": self.preemptions,
        }

    def release_owned(self, slot: int) -> None:
        """Free `slot`'s pages, keeping its queue entry (a preempted slot: the caller re-queues it)."""
        self.free.extend(reversed(self.owned[slot]))
        self.owned[slot] = []
        self.host[slot] = SCRATCH_PAGE

    def permute(self, order: list[int]) -> None:
        """Slots `order` move to [0, len(order)) (the batch's compaction)."""
        n = len(order)
        for name in ("owned", "entry", "stamp"):
            values = getattr(self, name)
            values[:n] = [values[i] for i in order]
        self.host[:n] = self.host[order]


def uses_pages(sampling, continued, keeps_episodes: bool) -> bool:
    """Whether a native call holds its K/V in pages: its rows can finish early (per-row limits, stop tokens),
    and no bookkeeping needs one contiguous layout (continued turns and calls that keep episode K/V for
    them, recorded expert routes)."""
    finish_early = bool(sampling.max_new_tokens_per_prompt) or bool(
        sampling.stop_token_ids and not sampling.ignore_eos
    )
    return finish_early and continued is None and not keeps_episodes and not sampling.routed_experts


def positions_at(table: torch.Tensor, num: int, page: int) -> torch.Tensor:
    """Flat cache positions of positions [0, num) of each row of `table` (rows, pages per row) -> (rows, num)."""
    ar = torch.arange(num, device=table.device)
    return table[:, ar // page].long() * page + ar % page


def paged_check(st, sched: PagedSlots, out, width: int, queue: list[Pending], prompts, horizon, pad_id, n):
    """The paged part of a host check of slots [0, width) (`st`: engine/rollout/decode_state.py `SlotState`):
    free, grow and preempt (`PagedSlots.check`); a preempted slot stops there (it reads and writes the
    scratch page like a finished one) and its row goes back to the front of `queue`, its prompt (of sample
    group `row // n`) and response so far appended to `prompts`. Returns (live slots, the bound of every
    slot's position, the live slots leading the batch, each slot's liveness)."""
    alive, cur, step = torch.stack((st.alive[:width].long(), st.cur[:width], st.step[:width])).tolist()
    alive = [bool(a) for a in alive]
    preempted = sched.check(alive, cur, horizon)
    if preempted:
        back = []
        for s in reversed(preempted):  # earliest admitted first
            entry, k = sched.entry[s], step[s]
            sched.entry[s], alive[s] = None, False
            response = out.ids[:k, entry.row].tolist()
            prompts.append(list(prompts[entry.row // n]) + response)
            back.append(Pending(entry.row, len(prompts) - 1, k))
        queue[:0] = back
        index = torch.tensor(preempted, device=st.tokens.device)
        st.alive[index], st.tokens[index], st.pad[index] = False, pad_id, st.cur[index]
    st.table[:width].copy_(sched.host[:width])
    lead = next((s for s in range(width) if not alive[s]), width)
    return sum(alive), max(cur), lead, alive
