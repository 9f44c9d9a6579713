"""Paged KV of the native engine (engine/rollout/paged_kv.py): the page bookkeeping's invariants, the forward
through a scattered page table against the contiguous cache, and whole calls against references (the
contiguous layout under the same seed; one batch with every row; greedy generation through preemptions)."""

from __future__ import annotations

import random

import hf_tiny
import pytest
import torch
from test_rollout_native import CPU, engine_for, random_prompts, rollout_weights_from_hf, tiny  # noqa: F401

from engine.rollout.base import SamplingParams
from engine.rollout.native import NativeRollout
from engine.rollout.paged_kv import SCRATCH_PAGE, PagedSlots, Pending, positions_at


def check_books(sched: PagedSlots) -> None:
    """Every page but the scratch page is free or owned by one slot, and the table says what the slots own."""
    owned = [p for pages in sched.owned for p in pages]
    assert sorted(owned + sched.free) == list(range(1, sched.num_pages))
    for s, pages in enumerate(sched.owned):
        assert sched.host[s, : len(pages)].tolist() == pages
        assert sched.host[s, len(pages) :].eq(SCRATCH_PAGE).all()


def test_page_books_balance_through_admit_grow_preempt_and_compaction():
    """A random schedule: admissions (`fit`), host checks with finishing rows, growth and preemption,
    compactions. No page is lost or owned twice, growth covers the next interval of every live slot that
    is not preempted, the latest admitted go first, and the oldest live row is never preempted."""
    rnd = random.Random(0)
    sched = PagedSlots(num_pages=41, page=4, slots=8, seq_len=40)
    queue = [Pending(r, r) for r in range(60)]
    lens = {r: rnd.randint(1, 9) for r in range(60)}
    alive, cur, preempted_any = [False] * 8, [0] * 8, False
    for _ in range(400):
        live = sum(alive)
        if not queue and not live:
            break
        if queue:
            order = [s for s in range(8) if alive[s]] + [s for s in range(8) if not alive[s]]
            sched.permute(order)
            alive, cur = [alive[s] for s in order], [cur[s] for s in order]
            k = sched.fit(queue, lambda e: (lens[e.prompt], 20), 8 - live, live, 2)
            assert k >= 1 or live  # something always fits an empty batch
            entries, queue[:k] = queue[:k], []
            if entries:
                plen = max(lens[e.prompt] for e in entries)
                sched.admit(live, entries, plen + 3)
                for s in range(live, live + k):
                    alive[s], cur[s] = True, plen
            check_books(sched)
        cur = [c + rnd.randint(0, 8) if a else c for a, c in zip(alive, cur)]
        cur = [min(c, 39 - 3) for c in cur]
        alive = [a and rnd.random() > 0.1 for a in alive]
        live_before = [s for s in range(8) if alive[s]]
        oldest = min(live_before, key=lambda s: sched.stamp[s], default=None)
        stamps = {s: sched.stamp[s] for s in live_before}
        preempted = sched.check(alive, cur, 2)
        preempted_any |= bool(preempted)
        assert oldest not in preempted
        if preempted:  # the latest admitted first
            kept = [s for s in live_before if s not in preempted]
            assert min(stamps[s] for s in preempted) > max(stamps[s] for s in kept)
        for s in preempted:
            alive[s] = False
            queue.insert(0, sched.entry[s])
            sched.entry[s] = None
        for s in range(8):
            if alive[s]:
                assert len(sched.owned[s]) * 4 >= min(cur[s] + 3, 40)
            else:
                assert not sched.owned[s]
        check_books(sched)
    assert preempted_any and not queue, (preempted_any, len(queue))


def test_decode_through_a_scattered_page_table_equals_the_contiguous_cache(tiny):  # noqa: F811
    """The forward's paged path (SDPA over gathered keys, the writes through the table) on pages in a shuffled
    order gives the contiguous cache's logits bit for bit (float32, CPU), step after step."""
    engine = engine_for(tiny, "qwen3")
    model, shape = engine.model, engine.shape
    rows, plen, page, steps = 3, 5, 4, 6
    seq_len = plen + steps + 1
    per_row = -(-seq_len // page)
    pool = engine.pool
    k_rows, v_rows = pool.views(rows, per_row * page)
    k_rows, v_rows = [t.clone() for t in k_rows], [t.clone() for t in v_rows]
    k_flat, v_flat = pool.flat_views((rows * per_row + 1) * page)
    pages = torch.randperm(rows * per_row, generator=torch.Generator().manual_seed(0)) + 1
    table = pages.view(rows, per_row).to(torch.int32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape.vocab_size, (rows, plen), generator=g)
    pad = torch.tensor([0, 2, 4])
    order = torch.arange(rows)
    with torch.inference_mode():
        a = model.prefill(ids, pad, k_rows, v_rows, order)
        b = model.prefill(ids, pad, k_flat, v_flat, order, positions_at(table, plen, page))
        assert torch.equal(a, b)
        cur = torch.full((rows,), plen)
        for _ in range(steps):
            tokens = a.argmax(-1)
            a = model.decode(tokens, pad, cur, k_rows, v_rows, int(cur.max()) + 1)
            b = model.decode(tokens, pad, cur, k_flat, v_flat, int(cur.max()) + 1, table, page)
            assert torch.equal(a, b)
            cur = cur + 1


def long_tail(vocab: int):
    prompts = random_prompts(vocab, lens=tuple(range(3, 15)), seed=4)
    limits = (24, 3, 2, 5, 2, 24, 3, 2, 6, 2, 3, 2)
    return prompts, limits


def test_pages_hold_more_rows_than_contiguous_slots(tiny):  # noqa: F811
    """A budget of three whole rows: the contiguous layout decodes three rows at a time, pages hold the
    short rows beside the long ones (a wider batch, fewer decode steps); every row equals a run with all
    rows in one batch (greedy, float32: log-probs within 1e-5)."""
    shape = tiny["qwen2"][0]
    prompts, limits = long_tail(shape.vocab_size)
    sampling = SamplingParams(
        n=2, temperature=0.0, max_new_tokens=24, max_new_tokens_per_prompt=limits, ignore_eos=True
    )
    ref = engine_for(tiny, "qwen2").generate(prompts, sampling)
    per_row = engine_for(tiny, "qwen2").pool.bytes_per_sequence(40)  # longest prompt 14 + 24, rounded up to 8
    runs = {}
    for paged in (False, None):  # None: pages where the budget binds, as here
        engine = engine_for(tiny, "qwen2", kv_cache_budget_bytes=3 * per_row, check_every=1, paged_kv=paged)
        out = engine.generate(prompts, sampling)
        assert torch.equal(out.response_ids, ref.response_ids) and torch.equal(
            out.response_mask, ref.response_mask
        )
        torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)
        runs[paged is None] = dict(engine.last_stats), max(engine.last_stats_by_width or {0: 0})
    (flat, flat_width), (pages, paged_width) = runs[False], runs[True]
    assert flat["slots"] == 3 and flat_width <= 3 and not flat["paged"]
    assert pages["paged"] and paged_width > 3, pages
    assert pages["decode_steps"] < flat["decode_steps"], (pages, flat)
    assert pages["kv_peak_pages"] <= pages["kv_pages"]


@pytest.mark.parametrize("n", [1, 2])
def test_preempted_rows_resume_where_they_stopped(tiny, n):  # noqa: F811
    """Stop tokens and no per-row limits (lengths unknown up front), a budget too small for the live rows'
    growth: rows are preempted, re-queued with their response so far and prefilled with it; every row
    still equals an unconstrained run (greedy, float32: tokens exact, log-probs within 1e-5)."""
    shape = tiny["llama"][0]
    prompts = random_prompts(shape.vocab_size, lens=tuple(range(1, 13)), seed=9)
    free = engine_for(tiny, "llama").generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=40))
    stop = int(torch.bincount(free.response_ids[:, 20:].flatten()).argmax())  # rows end late, some never
    sampling = SamplingParams(n=n, temperature=0.0, max_new_tokens=40, stop_token_ids=(stop,))
    ref = engine_for(tiny, "llama").generate(prompts, sampling)
    per_row = engine_for(tiny, "llama").pool.bytes_per_sequence(56)  # longest prompt 12 + 40, rounded up to 8
    engine = engine_for(tiny, "llama", kv_cache_budget_bytes=2 * per_row, check_every=2)
    out = engine.generate(prompts, sampling)
    assert engine.last_stats["preemptions"] >= 1, engine.last_stats
    assert torch.equal(out.response_ids, ref.response_ids) and out.finish_reasons == ref.finish_reasons
    assert torch.equal(out.response_mask, ref.response_mask)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)


def test_sampling_under_a_seed_equals_the_contiguous_layout(tiny):  # noqa: F811
    """Where the budget holds every row, pages change where K/V live and nothing else: sampled tokens
    (n = 2, temperature 1, stop tokens and per-row limits) and their log-probs are those of the contiguous
    layout bit for bit."""
    shape = tiny["qwen2"][0]
    prompts, limits = long_tail(shape.vocab_size)
    sampling = SamplingParams(
        n=2, temperature=1.0, max_new_tokens=24, max_new_tokens_per_prompt=limits, stop_token_ids=(7,), seed=5
    )
    a = engine_for(tiny, "qwen2", paged_kv=False).generate(prompts, sampling)
    paged = engine_for(tiny, "qwen2", paged_kv=True)
    b = paged.generate(prompts, sampling)
    assert paged.last_stats["paged"] == 1
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.log_probs, b.log_probs)
    assert a.finish_reasons == b.finish_reasons


def test_fit_keeps_every_row_of_a_chunk_inside_a_row_of_pages():
    """A preempted row's prompt holds its response so far: padded to it, a fresh row with many tokens left
    would run past a row's pages (40 positions here), so it waits for the next chunk; rows that fit together
    are taken together, and an empty batch always takes its first row."""
    sched = PagedSlots(num_pages=200, page=4, slots=8, seq_len=40)
    lengths = {0: (30, 5), 1: (6, 30), 2: (8, 4), 3: (9, 30)}
    queue = [Pending(r, r) for r in (0, 1)]
    assert sched.fit(queue, lambda e: lengths[e.prompt], 8, 0, 2) == 1
    queue = [Pending(r, r) for r in (2, 1, 3)]
    assert sched.fit(queue, lambda e: lengths[e.prompt], 8, 0, 2) == 3
    assert sched.fit(queue, lambda e: lengths[e.prompt], 2, 0, 2) == 2


def test_rows_stay_inside_a_position_limit_that_is_not_a_page_multiple(tmp_path):
    """max_position_embeddings 61 (CPU pages of 8: a row of pages holds 64): a preempted row's prompt (its
    response so far) pads the fresh rows of its chunk, and none may then write past position 61, which the
    forward does not read (it gave a row a wrong last token). Tokens equal the contiguous layout's (greedy,
    float32), log-probs within 5e-5 (batch shapes differ)."""
    path = hf_tiny.save_tiny("llama", str(tmp_path / "llama61"), seed=3, max_position_embeddings=61)
    shape, weights = rollout_weights_from_hf(path)

    def make(**kw) -> NativeRollout:
        engine = NativeRollout(shape, CPU, **kw)
        engine.set_weights(weights)
        return engine

    prompts = random_prompts(shape.vocab_size, lens=(2, 11, 8, 2, 2, 12, 10), seed=648)
    sampling = SamplingParams(n=2, temperature=0.0, max_new_tokens=48, stop_token_ids=(67, 42))
    ref = make(paged_kv=False).generate(prompts, sampling)
    engine = make(kv_cache_budget_bytes=72 * make().pool.bytes_per_position(), paged_kv=True, check_every=4)
    out = engine.generate(prompts, sampling)
    assert engine.last_stats["preemptions"] >= 1 and engine.last_stats["seq_len"] == 61
    assert torch.equal(out.response_ids, ref.response_ids) and out.finish_reasons == ref.finish_reasons
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=5e-5, rtol=0)


def test_a_budget_of_one_row_without_room_for_the_scratch_page_stays_contiguous(tiny):  # noqa: F811
    """A budget of exactly one whole row: pages would need one more (the scratch page), so the default
    (paged_kv=None) decodes one contiguous row at a time as before pages existed; paged_kv=True says why
    it cannot."""
    shape = tiny["llama"][0]
    prompts = random_prompts(shape.vocab_size, lens=(5, 9, 3), seed=1)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(5,))
    ref = engine_for(tiny, "llama").generate(prompts, sampling)
    one_row = engine_for(tiny, "llama").pool.bytes_per_sequence(24)  # 9 + 12 rounded up to 8
    engine = engine_for(tiny, "llama", kv_cache_budget_bytes=one_row)
    out = engine.generate(prompts, sampling)
    assert engine.last_stats["slots"] == 1 and not engine.last_stats["paged"]
    assert torch.equal(out.response_ids, ref.response_ids)
    with pytest.raises(
        ValueError, match="paged_kv=True: the KV cache budget .* not the scratch page of 8 more"
    ):
        engine_for(tiny, "llama", kv_cache_budget_bytes=one_row, paged_kv=True).generate(prompts, sampling)
