"""The native rollout engine: batched KV-cache generation that runs directly on the rollout-layout weights
handed over by the weight transition (no copy into another model), tensor-parallel over the rollout TP group.

How a `generate` call runs (the forward itself is engine/rollout/model.py):
- rows = prompts x n, longest limit first, then longest prompt; at most `slots` rows decode at once (at most
  `max_num_seqs`, and as many as the KV cache budget holds: engine/rollout/kv_cache.py);
- prefill: each distinct prompt of an admitted batch once (left-padded, at most `prefill_tokens` tokens per
  forward: engine/rollout/prefill.py), its K/V written to the cache rows of its n samples; with n > 1 the
  decode attention of batches of `DecodeKernels.shared_prefix_min_rows` rows or more reads a group's prompt
  from its first live sample's copy (`DecodeKernels.shared_prefix`: triton_decode.py, decode_state.py);
- decode: one token for every slot per step, each slot at its own cache position (engine/rollout/
  decode_state.py); a finished row is masked at once, and the batch is compacted (live rows moved to the
  front) only when enough rows finished: a quarter of the batch in eager mode, one batch bucket down with
  CUDA graphs (and before an admission, unless the live slots already lead the batch);
- calls whose rows can finish early (stop tokens, per-row limits), where the KV budget holds fewer whole
  rows than the call decodes at once, keep K/V in pages (engine/rollout/paged_kv.py): a row holds the
  positions it wrote, compaction moves page-table rows, and finished rows' slots and pages go to the next
  rows at a host check where an eighth of the slots' worth fits, so that GPU time and memory track the
  tokens generated rather than each chunk's longest row. Without pages (budget to spare, `paged_kv=False`,
  the flash kernel) each slot has the longest row's length, compaction copies the live part and rows are
  admitted where an eighth of the slots is free; fixed lengths, turns inside `hold()` and recorded routes
  keep that layout and start the next rows when the batch is empty;
- on CUDA the decode step is replayed from a CUDA graph per batch bucket (engine/rollout/cuda_graphs.py) and
  the host checks for finished rows every `check_every` steps only; on CPU every step, inside
  `parallel.cpu.no_shim_overhead()` (the megatron CPU shims' TorchFunctionMode costs a Python call per op).
- the turns of multi-turn episodes (`hold(max_len)`, then `generate_continued`): when a call's rows fit one
  chunk, the cache keeps each row's K/V (finished rows are compacted behind the live ones, not overwritten),
  laid out for max_len positions; the next turn moves each continued row's K/V to this call's left padding
  (one gather per layer: RoPE positions count real tokens, so they stay valid) and prefills only its new
  tokens against them (engine/rollout/model.py `prefill_continued`). Rows that did not fit one chunk, or a
  turn longer than the layout, are prefilled in full (`last_stats["continued_rows"]` says which happened).

Every TP rank of the group draws the same tokens: they see bitwise-identical logits (all-gathered) and
use the same seed. Same inputs, seed and engine settings give the same responses; a different chunking
(`max_num_seqs`, KV budget) changes batch shapes, hence the random stream and floating-point reductions.
Log-probs are always returned, `SamplingParams.log_probs` or not: the sampler has them at no extra cost.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from engine.models.builder import ModelShape
from engine.rollout.base import (
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    check_limits_match,
    check_prompts,
    check_sampling,
)
from engine.rollout.cuda_graphs import DecodeGraphs, batch_buckets, bucket_for
from engine.rollout.decode_state import CallOutputs, SlotState, compact_paged, compact_slots, record_tokens
from engine.rollout.kept_rows import KeptRows, kept_rows, prefill_continued
from engine.rollout.kv_cache import KVCachePool
from engine.rollout.model import DecodeKernels, RolloutModel
from engine.rollout.moe_experts import use_cuda_graphs
from engine.rollout.paged_kv import PagedSlots, Pending, paged_check, uses_pages
from engine.rollout.prefill import prefill_rows
from engine.rollout.rope import rope_tables
from engine.rollout.routes import RouteRecorder
from parallel.cpu import no_shim_overhead
from parallel.rollout_weights import RolloutWeights


class NativeRollout(RolloutEngine):
    """KV-cache generation on `RolloutWeights`; call `set_weights` after each train -> rollout transition.

    `max_num_seqs`: most sequences decoded at once (`rollout.max_num_seqs`); `pad_id` pads the responses.
    `kv_cache_budget_bytes`: KV cache memory (None: `kv_cache_memory_fraction` of the free GPU memory on CUDA,
    1 GiB at most on CPU); it bounds the sequences decoded at once, larger batches are chunked.
    `cuda_graphs` (None: on CUDA wherever the decode step has no host sync: engine/rollout/moe_experts.py
    `use_cuda_graphs`; calls recording routed experts decode eagerly), `keep_cache` (None: on CPU only; on CUDA the cache and graphs are freed
    after each call so that training gets the memory back), `prefill_tokens` (tokens per prefill forward),
    `check_every` (decode steps between host checks for finished rows; None: 1 on CPU, 8 on CUDA),
    `kernels` (the forward's fast kernels, engine/rollout/model.py `DecodeKernels`; default: all where they apply),
    `keep_episode_cache` (inside `hold()`, keep each row's K/V for `generate_continued`; False: every call
    prefills its prompts in full), `paged_kv` (calls whose rows finish at different times hold their K/V in
    pages, engine/rollout/paged_kv.py: True always, None where the budget holds fewer whole rows than the
    call decodes at once; False never: one contiguous region per slot, sized by the longest row).
    """

    def __init__(
        self,
        shape: ModelShape,
        device: torch.device,
        max_num_seqs: int = 256,
        pad_id: int = 0,
        *,
        kv_cache_budget_bytes: int | None = None,
        kv_cache_memory_fraction: float = 0.5,
        cuda_graphs: bool | None = None,
        keep_cache: bool | None = None,
        prefill_tokens: int = 8192,
        check_every: int | None = None,
        kernels: DecodeKernels | None = None,
        keep_episode_cache: bool = True,
        paged_kv: bool | None = None,
    ):
        device = torch.device(device)
        on_cuda = device.type == "cuda"
        if on_cuda and device.index is None:  # compare equal to the weights' cuda:<i>
            device = torch.device("cuda", torch.cuda.current_device())
        if max_num_seqs < 1:
            raise ValueError(f"rollout.max_num_seqs={max_num_seqs} must be >= 1")
        if cuda_graphs and not on_cuda:
            raise ValueError("cuda_graphs=True needs a CUDA device; leave it None (auto) on CPU")
        self.shape, self.device, self.max_num_seqs, self.pad_id = shape, device, max_num_seqs, pad_id
        self.kv_cache_budget_bytes = kv_cache_budget_bytes
        self.kv_cache_memory_fraction = kv_cache_memory_fraction
        self.use_graphs = use_cuda_graphs(shape, device, cuda_graphs)
        self.keep_cache = (not on_cuda) if keep_cache is None else keep_cache
        self.prefill_tokens, self.check_every = prefill_tokens, check_every or (8 if on_cuda else 1)
        self.seq_align = 64 if on_cuda else 8
        self.kernels = kernels or DecodeKernels()
        self.keep_episode_cache, self.paged_kv = keep_episode_cache, paged_kv
        self._holding = False
        self._hold_len: int | None = None
        self._kept: KeptRows | None = None
        self.weights: RolloutWeights | None = None
        self.model: RolloutModel | None = None
        self.pool: KVCachePool | None = None
        self.graphs = DecodeGraphs(device) if self.use_graphs else None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows: SlotState | None = None
        self._rows_version = 0
        self._recorder: RouteRecorder | None = None
        self._shared = False  # this call's: its samples read their prompt from one copy
        self.last_stats: dict[str, int] = {}
        self.last_stats_by_width: dict[int, list] = {}
        """Decode steps and host seconds per batch width of the last call, {width: [steps, seconds]}
        (timed between host checks, so only when rows can finish early)."""

    # ---- weights and memory ----------------------------------------------------------------------
    def set_weights(self, weights: RolloutWeights) -> None:
        embed = weights.params.get("embedding.word_embeddings.weight")
        if embed is None:
            raise KeyError("rollout weights lack 'embedding.word_embeddings.weight' (empty after to_train?)")
        if embed.device != self.device:
            raise ValueError(f"rollout weights are on {embed.device} but the engine runs on {self.device}")
        if self._rope is None or self._rope[0].dtype != embed.dtype:
            self._rope = rope_tables(self.shape, self.device, embed.dtype)
        self.weights = weights
        self.model = m = RolloutModel(self.shape, weights, self._rope, self.kernels)
        self.fused_draw = m.fused_sampler  # the Triton draw, on decode logits in the model's dtype
        use_cuda_graphs(self.shape, self.device, self.graphs is not None or None, m.dtype)
        if self.pool is None or self.pool.dtype != m.dtype or self.pool.groups != m.groups:
            self.pool = KVCachePool(
                self.shape.num_layers,
                m.groups,
                m.head_dim,
                m.dtype,
                self.device,
                self.kv_cache_budget_bytes,
                self.kv_cache_memory_fraction,
            )

    def release(self) -> None:
        """Free the KV cache, the decode state and the CUDA graphs."""
        if self.graphs is not None:
            self.graphs.clear()
        if self.pool is not None:
            self.pool.release()
        if self.model is not None:
            self.model.free_stacked_experts()
        self._rows = None
        self._kept = None

    def _rows_state(self, slots: int, pages_per_row: int = 0) -> SlotState:
        rows = SlotState.reuse(self._rows, slots, pages_per_row, self.pad_id, self.device)
        if rows is not self._rows:
            self._rows, self._rows_version = rows, self._rows_version + 1
        return rows

    # ---- generation ------------------------------------------------------------------------------
    @contextmanager
    def hold(self, max_len: int | None = None):
        """Keep the KV cache across the `generate` calls inside, and each row's K/V for `generate_continued`
        (with `keep_episode_cache`); freed on exit unless `keep_cache`. `max_len` (the longest prompt +
        response a call inside will need) sizes the cache once, so that the continuations fit its layout."""
        self._holding, self._hold_len, self._kept = True, max_len, None
        try:
            yield
        finally:
            self._holding, self._hold_len, self._kept = False, None, None
            if not self.keep_cache:
                self.release()

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        return self._generate(prompts, sampling, None)

    def generate_continued(
        self, prompts: list[list[int]], sampling: SamplingParams, previous: list[int]
    ) -> RolloutOutput:
        """`generate`, where prompt i extends row `previous[i]` of the latest call inside `hold()` (that row's
        prompt and response, then new tokens). When every such row is still in the cache and fits the
        cache's layout, each row's K/V are moved (within the cache) to where this call's left padding puts
        them and only the new tokens are prefilled; otherwise (not held, the previous call needed more
        than one chunk, n > 1, a longer layout) the prompts are prefilled in full."""
        if len(previous) != len(prompts):
            raise ValueError(f"generate_continued: {len(previous)} previous rows for {len(prompts)} prompts")
        kept = self._kept
        usable = (
            kept is not None
            and sampling.n == 1
            and len(set(previous)) == len(previous)
            and max(map(len, prompts), default=0) + sampling.max_new_tokens <= kept.seq_len
        )
        if usable:
            for i, r in enumerate(previous):
                if not 0 <= r < len(kept.tokens) or prompts[i][: len(kept.tokens[r])] != kept.tokens[r]:
                    raise ValueError(
                        f"generate_continued: prompt {i} does not start with row {r}'s prompt and response "
                        "of the previous call; pass the previous call's row index of each continued episode"
                    )
        return self._generate(prompts, sampling, (kept, previous) if usable else None)

    def _generate(self, prompts, sampling: SamplingParams, continued) -> RolloutOutput:
        """`generate`; `continued` = (the kept rows, the kept row of each prompt) or None (prefill in full)."""
        if self.model is None:
            raise RuntimeError("NativeRollout.generate called before set_weights()")
        check_sampling(sampling)
        check_limits_match(prompts, sampling)
        new = sampling.max_new_tokens
        check_prompts(prompts, self.shape.max_position_embeddings - new, self.shape.vocab_size)
        num_rows = len(prompts) * sampling.n
        if num_rows == 0:
            empty = torch.zeros(0, new)
            return RolloutOutput(empty.long(), empty, empty, [])
        longest, sched = max(len(p) for p in prompts), None
        paged = self.paged_kv is not False and self.model.attention != "flash"  # (flash: contiguous rows)
        paged = paged and uses_pages(sampling, continued, self._holding and self.keep_episode_cache)
        if continued is not None:  # the kept rows' layout
            seq_len, slots = continued[0].seq_len, continued[0].slots
        else:
            seq_len = self._seq_len(longest + new)
            slots = min(self.max_num_seqs, num_rows)
            budget = self._budget_slots(seq_len)  # auto: pages where whole rows would not all fit
            if paged and (self.paged_kv or budget < slots):  # (None: no room for the scratch page)
                sched = PagedSlots.for_budget(self.pool.max_positions(), self.seq_align, slots, seq_len)
                if sched is None and self.paged_kv:
                    raise ValueError(
                        f"paged_kv=True: the KV cache budget ({self.pool.budget_bytes()} bytes) holds one row of "
                        f"{seq_len} positions but not the scratch page of {self.seq_align} more; raise the budget"
                    )
            paged = sched is not None
            slots = slots if paged else min(slots, budget)
        # longest responses first (chunks of similar length), then longest prompts
        order = sorted(range(len(prompts)), key=lambda i: (-sampling.limit_of(i), -len(prompts[i])))
        rows = [(p * sampling.n + j, p) for p in order for j in range(sampling.n)]
        self.last_stats = {"slots": slots, "seq_len": seq_len, "paged": int(paged)}
        self.last_stats.update(dict.fromkeys(("chunks", "compactions", "decode_steps", "slot_steps"), 0))
        if self._holding:
            self.last_stats["continued_rows"] = 0 if continued is None else num_rows
        self.last_stats_by_width = {}
        if self.graphs is not None:
            self.graphs.capture_seconds.clear()
        # inside hold(): track where each row's K/V end up, when one chunk holds every row
        keep = self._holding and self.keep_episode_cache and num_rows <= slots
        self._recorder = RouteRecorder.for_call(self.model, prompts, sampling, continued, self.device)
        with torch.inference_mode(), no_shim_overhead():
            out = CallOutputs(
                ids=torch.full((new, num_rows + 1), self.pad_id, dtype=torch.long, device=self.device),
                log_probs=torch.zeros(new, num_rows + 1, device=self.device),
                mask=torch.zeros(new, num_rows + 1, dtype=torch.bool, device=self.device),
                stopped=torch.zeros(num_rows + 1, dtype=torch.bool, device=self.device),
            )
            if sampling.max_new_tokens_per_prompt:
                limits = [sampling.limit_of(r // sampling.n) for r in range(num_rows)] + [new]
                out.limit = torch.tensor(limits, dtype=torch.long, device=self.device)
            gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
            stops = None
            if sampling.stop_token_ids and not sampling.ignore_eos:
                stops = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=self.device)
            track = self._decode_rows(
                rows, prompts, sampling, gen, stops, out, slots, seq_len, continued, keep, sched
            )
            result = RolloutOutput(
                response_ids=out.ids[:, :num_rows].t().cpu(),
                response_mask=out.mask[:, :num_rows].t().float().cpu(),
                log_probs=out.log_probs[:, :num_rows].t().cpu(),
                finish_reasons=["stop" if s else "length" for s in out.stopped[:num_rows].tolist()],
                routed_experts=None if self._recorder is None else self._recorder.result(),
            )
            self._recorder = None
        if self._holding:
            self._kept = kept_rows(rows, prompts, result, track, slots, seq_len) if keep else None
        if self.graphs is not None:  # capture_s: host seconds of this call's captures (DecodeGraphs)
            captured = self.graphs.capture_seconds.values()
            self.last_stats.update(graphs=self.graphs.num_graphs, capture_s=round(sum(captured), 3))
        if not self.keep_cache and not self._holding:
            self.release()
        return result

    def _seq_len(self, needed: int) -> int:
        """Cache length for calls needing `needed` positions: rounded up (fewer distinct graph keys), never past
        the RoPE table; inside `hold(max_len)` at least max_len where the budget holds one such sequence."""
        align, limit = self.seq_align, self.shape.max_position_embeddings
        seq_len = min(-(-needed // align) * align, limit)
        if self._holding and self.keep_episode_cache and self._hold_len and self._hold_len > needed:
            held = min(-(-self._hold_len // align) * align, limit)
            if self.pool.max_slots(held) >= 1:
                return held
        return seq_len

    def _budget_slots(self, seq_len: int) -> int:
        slots = self.pool.max_slots(seq_len)
        if slots < 1:
            raise ValueError(
                f"the KV cache budget ({self.pool.budget_bytes()} bytes) cannot hold one sequence of {seq_len} "
                f"positions ({self.pool.bytes_per_sequence(seq_len)} bytes); raise kv_cache_budget_bytes "
                "(or kv_cache_memory_fraction on CUDA), or lower data.max_prompt_len / rollout.max_new_tokens"
            )
        return slots

    def _decode_rows(
        self, rows, prompts, sampling, gen, stops, out: CallOutputs, slots, seq_len, continued, keep, sched
    ):
        """Prefill and decode `rows` through `slots` cache slots. Rows are admitted in order: first as many as
        the slots hold, then, where rows can finish early (stop tokens or per-row limits) and no bookkeeping
        needs the call's rows in one batch (`keep`, `continued`, recorded routes), into the slots that finished
        rows free, at every host check where at least an eighth of the slots are free (the live slots are
        compacted to the front, the new rows prefilled behind them; with pages, `sched`: as many as the free
        KV pages hold, engine/rollout/paged_kv.py); otherwise when the batch is empty. With `keep`, return
        (chunk row of each slot or -1, left padding of each slot) as they end up."""
        self._shared = self.model.shared_prefix and sampling.n > 1
        if sched is not None:
            caches = self.pool.flat_views(sched.num_pages * sched.page)
            st = self._rows_state(slots, sched.pages_per_row)
        else:
            caches, st = self.pool.views(slots, seq_len), self._rows_state(slots)
        buckets = batch_buckets(slots) if self.graphs is not None else None
        scratch = out.stopped.numel() - 1
        if self.graphs is not None:
            ptrs = tuple(t.data_ptr() for t in (*self.weights.params.values(), *self.model.expert_views()))
            pages = sched.num_pages if sched else 0
            key = (ptrs, self.pool.version, slots, seq_len, self._rows_version, pages)
            self.graphs.invalidate_unless(key)
        rows_finish = stops is not None or out.limit is not None
        admit_late = rows_finish and not keep and continued is None and self._recorder is None
        queue = [Pending(r, p) for r, p in rows]
        prompts = list(prompts)  # preempted rows append their prompt and response so far
        track, alive = None, []  # alive: the slots' state at the last host check (paged)
        t = end = live = width = top = admitted_at = lead = 0  # t: decode steps; top >= every cur
        since, since_steps = time.perf_counter(), 0
        while True:
            if t >= end:  # every admitted row has had all its steps
                live = 0
            take = 0
            if queue and (live == 0 or (admit_late and t % self.check_every == 0)):
                if sched is not None:  # as many as the free pages hold
                    take = sched.admissible(queue, prompts, sampling, slots, live, self.check_every)
                elif live == 0 or (slots - live) * 8 >= slots:  # all the free slots hold, an eighth free
                    take = min(slots - live, len(queue))
            if take:
                if live and self._live_to_front(
                    caches, st, live, width, top, scratch, lead, None, sched, alive
                ):
                    self.last_stats["compactions"] += 1
                entries, queue[:take] = queue[:take], []
                track, plen = self._admit(
                    entries, prompts, sampling, gen, stops, out, caches, st, live, continued, keep, sched
                )
                n = live + take
                width = bucket_for(n, buckets) if buckets else n
                st.cur[n:width] = 0  # nothing of this call's rows is there
                st.set_idle(n, width, scratch, self.pad_id)
                if self._shared:
                    st.refresh_prefix_from(width)
                end = max(end, t + max(sampling.limit_of(e.row // sampling.n) - e.start for e in entries) - 1)
                top, live, admitted_at, alive = max(top, plen), n, t, [True] * n + [False] * (width - n)
                if t >= end:  # every admitted row had its only token from the prefill (limits of 1)
                    continue
            elif live == 0:
                break
            logits = self._decode(width, top, caches, st, seq_len, sched)
            if self._recorder is not None:  # the step fed response token t - admitted_at of the live slots
                self._recorder.decode(st.row_of[:width], st.alive[:width], t - admitted_at)
            st.cur[:width] += st.alive[:width]
            t, top, since_steps = t + 1, top + 1, since_steps + 1
            self.last_stats["decode_steps"] += 1
            self.last_stats["slot_steps"] += width
            record_tokens(logits, sampling, gen, stops, out, st, 0, self.pad_id, self.fused_draw)
            if rows_finish and t < end and t % self.check_every == 0:
                if sched is None:
                    alive_t = st.alive[:width]  # live slots, their bound, and how many lead the batch
                    live, top, lead = torch.stack(
                        (alive_t.sum(), st.cur[:width].max(), alive_t.cumprod(0).sum())
                    ).tolist()
                else:
                    live, top, lead, alive = paged_check(
                        st, sched, out, width, queue, prompts, self.check_every, self.pad_id, sampling.n
                    )
                now = time.perf_counter()  # the host waited for the steps queued since the last check
                self._time_width(width, since_steps, now - since)
                since, since_steps = now, 0
                width, lead = self._maybe_compact(
                    live, width, top, caches, st, buckets, scratch, track, lead, sched, alive
                )
                if self._shared:  # rows finished, were preempted or moved
                    st.refresh_prefix_from(width)
        if sched is not None:
            self.last_stats.update(sched.stats())
        return track

    def _admit(self, entries, prompts, sampling, gen, stops, out, caches, st, lo, continued, keep, sched):
        """Prefill the rows of `entries` into slots [lo, lo + len(entries)) and sample their first tokens (a
        preempted row's next one); returns (`track` when `keep`, the padded prompt length)."""
        self.last_stats["chunks"] += 1
        chunk = [(e.row, e.prompt) for e in entries]
        n, hi = len(chunk), lo + len(chunk)
        if sched is not None:  # pages for the prompts and the positions written until the next host check
            if lo == 0:
                sched.release(0, len(sched.owned))
            plen = max(len(prompts[p]) for _, p in chunk)
            sched.admit(lo, entries, plen + self.check_every + 1)
            st.table.copy_(sched.host)
            args = (caches, self._recorder, st.table[lo:hi], sched.page)
            logits, pad_r, plen = prefill_rows(
                self.model, self.pad_id, self.prefill_tokens, chunk, prompts, *args
            )
        elif continued is None:  # (continued rows come first, from anywhere in the cache: lo = 0)
            views = tuple([c[lo:hi] for c in layer] for layer in caches)
            args = (views, self._recorder)
            logits, pad_r, plen = prefill_rows(
                self.model, self.pad_id, self.prefill_tokens, chunk, prompts, *args
            )
        else:
            args = (self.model, self.pad_id, self.prefill_tokens, chunk, prompts, caches, *continued)
            logits, pad_r, plen = prefill_continued(*args)
        track = None
        if keep:  # permuted with the slots when finished rows are compacted away
            track = (
                torch.full((st.pad.numel(),), -1, dtype=torch.long, device=self.device),
                st.pad.new_zeros(st.pad.numel()),
            )
            track[0][:n], track[1][:n] = torch.arange(n, device=self.device), pad_r
        st.admit(lo, chunk, pad_r, plen, [e.start for e in entries], self.last_stats["chunks"])
        record_tokens(logits, sampling, gen, stops, out, st, lo, self.pad_id, self.fused_draw)
        return track, plen

    def _time_width(self, width: int, steps: int, seconds: float) -> None:
        """Add `steps` decode steps of batch width `width` that took `seconds` (host clock between two host
        checks; the first interval of a width includes its CUDA-graph capture) to `last_stats_by_width`."""
        if steps:
            total = self.last_stats_by_width.setdefault(width, [0, 0.0])
            total[0] += steps
            total[1] += seconds

    def _maybe_compact(self, live, width, top, caches, st, buckets, scratch, track, lead, sched, alive):
        """Move the live slots to the front when enough finished (no copy when the first `lead` slots, all
        live, are all of them); returns (the new batch width: one batch bucket down with CUDA graphs, a quarter
        of the batch in eager mode; the live slots leading it)."""
        if live == 0:  # the next admission (or the end) follows
            return width, lead
        target = bucket_for(live, buckets) if buckets else live
        if (target >= width) if buckets else (live * 4 > width * 3):
            return width, lead
        self._live_to_front(caches, st, live, width, top, scratch, lead, track, sched, alive)
        self.last_stats["compactions"] += 1  # the batch narrows, with or without a copy
        return target, live

    def _live_to_front(self, caches, st, live, width, top, scratch, lead, track, sched, alive) -> bool:
        """Move the `live` slots to the front (one copy of their K/V up to `top`; paged: of their page-table
        rows, `alive` being the host's view of the slots) unless the first `lead` slots, all live, are all of
        them; True where it moved them."""
        if lead >= live:
            return False
        if sched is not None:
            compact_paged(st, sched, alive, live, width, scratch, self.pad_id)
        else:
            compact_slots(caches, st, live, width, top, scratch, self.pad_id, track)
        return True

    def _decode(self, width: int, top: int, caches, st: SlotState, seq_len: int, sched) -> torch.Tensor:
        cache_k, cache_v = caches

        def step(b: int, num_keys: int = seq_len) -> torch.Tensor:
            if sched is not None:  # the flat caches, row r's positions through its page-table row
                rows_k, rows_v, paged = cache_k, cache_v, (st.table[:b], sched.page)
            else:
                rows_k, rows_v, paged = [k[:b] for k in cache_k], [v[:b] for v in cache_v], ()
            args = (st.tokens[:b], st.pad[:b], st.cur[:b], rows_k, rows_v, num_keys, *paged)
            shared = self._shared and b >= self.kernels.shared_prefix_min_rows
            prefix = st.prompt_sources(b) if shared else None
            return self.model.decode(*args, upcast=not self.fused_draw, prefix=prefix)

        if self.graphs is None or self._recorder is not None:  # the recorder reads each step's routes
            return step(width, min(top + 1, seq_len))
        # warm-up and capture write K/V at the last cache position, which no step reads before writing it
        saved = []
        return self.graphs.run(
            width,
            step,
            lambda: (saved.append(st.cur.clone()), st.cur.fill_(seq_len - 1)),
            lambda: st.cur.copy_(saved[0]),
        )
