"""The native rollout engine (engine/rollout/native.py, model.py, sampler.py, kv_cache.py) at rollout TP=1.

World size: none. Every test runs in the pytest process without a process group: the rollout weights are
cut from tiny random Hugging Face checkpoints (tests/engine/hf_tiny.py) with the project's weight map
(`shard_from_hf`), so the engine sees exactly the layout a weight transition hands it. The parity with the
megatron training forward and rollout TP=2 are checked in tests/engine/test_rollout_tp.py (2 gloo ranks).

Tolerances (float32): log-probs within 1e-4 of transformers' (measured ~1e-6); greedy tokens exact.
"""

from __future__ import annotations

import time
from dataclasses import replace

import hf_tiny
import pytest
import torch

from engine.models.hf import HFCheckpoint
from engine.models.hf_map import WEIGHT_MAP, Split, hf_names, shard_from_hf
from engine.rollout.base import SamplingParams
from engine.rollout.native import NativeRollout
from engine.tools.parity import hf_model_shape
from parallel.rollout_weights import RolloutWeights

CPU = torch.device("cpu")
LOGP_TOL = 1e-4
PROMPT_LENS = (1, 4, 9, 13, 6, 2)
FAMILIES = ("qwen2", "llama", "qwen3")  # tied + QKV bias; untied + Llama-3 RoPE; QK-norm
# 4 experts top-2: renormalised (Qwen3-MoE); unnormalised with a gated shared expert (Qwen2-MoE)
MOE_FAMILIES = hf_tiny.MOE_FAMILIES


def rollout_weights_from_hf(path: str) -> tuple:
    """(shape, RolloutWeights at TP=1) with every tensor in megatron's layout, read through WEIGHT_MAP."""
    shape = hf_model_shape(path, 1)
    params = {}
    with HFCheckpoint(path) as ckpt:
        for rule in WEIGHT_MAP:
            experts = range(shape.moe.num_experts if shape.moe and rule.expert else 1)
            layers = range(shape.num_layers) if "{layer}" in rule.megatron else [None]
            for layer, expert in ((layer, e if rule.expert else None) for layer in layers for e in experts):
                names = hf_names(rule, layer, expert)
                if names[0] not in ckpt:  # no lm_head when tied, no bias / QK-norm / experts in some families
                    continue
                hf = [ckpt.tensor(n) for n in names]
                rows = shape.padded_vocab_size if rule.split is Split.VOCAB else sum(t.shape[0] for t in hf)
                out = torch.empty(rows, *hf[0].shape[1:])
                shard_from_hf(rule, lambda i, index, hf=hf: hf[i][index], out, shape, 1, 0)
                params[rule.megatron.format(layer=layer, expert=expert)] = out
    return shape, RolloutWeights(params, 1, 0, None, None, 0, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """family -> (shape, weights, transformers model)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("rollout_hf")
    out = {}
    for i, family in enumerate(FAMILIES + MOE_FAMILIES):
        path = hf_tiny.save_tiny(family, str(root / family), seed=i)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # the engine stops only at SamplingParams.stop_token_ids
        out[family] = (*rollout_weights_from_hf(path), hf)
    return out


def engine_for(tiny, family: str, **kw) -> NativeRollout:
    shape, weights, _ = tiny[family]
    engine = NativeRollout(shape, CPU, pad_id=kw.pop("pad_id", 0), **kw)
    engine.set_weights(weights)
    return engine


def random_prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def hf_greedy(hf, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generation: (tokens, log-prob of each under log_softmax of its step's logits)."""
    with torch.no_grad():
        res = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = res.sequences[0, len(prompt) :]
    logits = torch.stack(res.logits, 1)[0].float()  # (new, vocab)
    return tokens.tolist(), logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


def hf_log_probs(hf, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Teacher-forced log-probs of `response` under softmax(logits / temperature)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response])).logits[0].float()
    logits = logits[len(prompt) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def largest_log_prob_error(hf, prompts: list[list[int]], n: int, out) -> float:
    """Largest distance of a generate call's sampled-token log-probs (temperature 1; rows = prompts x n) to
    transformers' teacher-forced ones on the same tokens."""
    err = 0.0
    for row, prompt in enumerate(p for p in prompts for _ in range(n)):
        k = int(out.response_mask[row].sum())
        ref = hf_log_probs(hf, prompt, out.response_ids[row, :k].tolist(), 1.0)
        err = max(err, float((out.log_probs[row, :k] - ref).abs().max()))
    return err


# ---- parity with transformers ---------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_greedy_equals_transformers_token_for_token(tiny, family):
    """Left-padded prompts of different lengths, chunked (3 sequences at once) and sorted by length."""
    hf = tiny[family][2]
    engine = engine_for(tiny, family, max_num_seqs=3)
    prompts = random_prompts(tiny[family][0].vocab_size)
    new = 12
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new))
    assert engine.last_stats["chunks"] == 2
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logp = hf_greedy(hf, prompt, new)
        assert out.response_ids[i].tolist() == ref_tokens, (family, i)
        torch.testing.assert_close(out.log_probs[i], ref_logp, atol=LOGP_TOL, rtol=0)
    assert out.response_mask.eq(1).all() and out.finish_reasons == ["length"] * len(prompts)


@pytest.mark.parametrize("family", ("qwen2", "llama", *MOE_FAMILIES))
def test_sampled_log_probs_are_full_vocab_at_the_temperature(tiny, family):
    """top-k restricts the draws; the log-prob is still under softmax(logits / T) over the whole vocabulary."""
    hf = tiny[family][2]
    engine = engine_for(tiny, family)
    prompts = random_prompts(tiny[family][0].vocab_size, lens=(3, 7))
    sampling = SamplingParams(n=2, temperature=0.7, top_k=5, max_new_tokens=10, seed=3)
    out = engine.generate(prompts, sampling)
    for row in range(out.response_ids.shape[0]):
        response = out.response_ids[row].tolist()
        ref = hf_log_probs(hf, prompts[row // 2], response, sampling.temperature)
        torch.testing.assert_close(out.log_probs[row], ref, atol=LOGP_TOL, rtol=0)


# ---- sampling: seeds, n, stops, lengths ------------------------------------------------------------


def test_n_samples_reproducible_under_a_seed_and_seed_dependent(tiny):
    engine = engine_for(tiny, "qwen2")
    prompts = random_prompts(tiny["qwen2"][0].vocab_size, lens=(5, 8))
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=11)
    a, b = engine.generate(prompts, sampling), engine.generate(prompts, sampling)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.log_probs, b.log_probs)
    c = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=12))
    assert not torch.equal(a.response_ids, c.response_ids)
    assert a.response_ids.shape == (8, 8)
    for p in range(2):  # the n samples of a prompt are adjacent and differ
        assert len({tuple(r) for r in a.response_ids[p * 4 : p * 4 + 4].tolist()}) > 1


def test_stop_tokens_truncate_and_compaction_keeps_rows_right(tiny):
    """Greedy rows must equal the no-stop run cut after their first stop token, whatever the compactions."""
    prompts = random_prompts(tiny["llama"][0].vocab_size, lens=tuple(range(1, 17)), seed=5)
    new, pad = 24, 100
    engine = engine_for(tiny, "llama", pad_id=pad)
    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new))
    counts = torch.bincount(free.response_ids.flatten())
    stop = int(counts.argmax())  # the most frequent token: most rows stop, at different steps
    out = engine.generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=new, stop_token_ids=(stop,))
    )
    assert engine.last_stats["compactions"] >= 1
    stopped = 0
    for i in range(len(prompts)):
        ref = free.response_ids[i].tolist()
        length = ref.index(stop) + 1 if stop in ref else new
        stopped += stop in ref
        assert out.response_ids[i, :length].tolist() == ref[:length]
        assert out.response_ids[i, length:].eq(pad).all() and out.log_probs[i, length:].eq(0).all()
        assert out.response_mask[i].sum() == length and out.response_mask[i, :length].eq(1).all()
        torch.testing.assert_close(out.log_probs[i, :length], free.log_probs[i, :length], atol=1e-6, rtol=0)
        assert out.finish_reasons[i] == ("stop" if stop in ref else "length")
    assert stopped >= len(prompts) // 2
    ignored = engine.generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=new, stop_token_ids=(stop,), ignore_eos=True)
    )
    assert torch.equal(ignored.response_ids, free.response_ids) and set(ignored.finish_reasons) == {"length"}


def test_small_kv_budget_chunks_instead_of_growing(tiny):
    shape = tiny["qwen2"][0]
    prompts = random_prompts(shape.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    ref = engine_for(tiny, "qwen2").generate(prompts, greedy)
    engine = engine_for(tiny, "qwen2")
    per_seq = engine.pool.bytes_per_sequence(24)  # longest prompt 13 + 10 new, rounded up to 8
    engine = engine_for(tiny, "qwen2", kv_cache_budget_bytes=2 * per_seq)
    out = engine.generate(prompts, greedy)
    assert engine.last_stats["slots"] == 2 and engine.last_stats["chunks"] == 3
    assert engine.pool.allocated_bytes() == 2 * per_seq
    assert torch.equal(out.response_ids, ref.response_ids)


def test_errors_name_the_problem(tiny):
    shape = tiny["qwen2"][0]
    engine = engine_for(tiny, "qwen2")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], greedy)
    too_long = [1] * (shape.max_position_embeddings - 7)
    with pytest.raises(ValueError, match="prompt 0 has 121 tokens.*rollout.max_new_tokens"):
        engine.generate([too_long], greedy)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[shape.vocab_size]], greedy)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1]], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="no room for a prompt"):
        engine.generate([[1]], SamplingParams(max_new_tokens=shape.max_position_embeddings))
    with pytest.raises(RuntimeError, match="before set_weights"):
        NativeRollout(shape, CPU).generate([[1]], greedy)
    with pytest.raises(ValueError, match="kv_cache_budget_bytes"):
        engine_for(tiny, "qwen2", kv_cache_budget_bytes=16).generate([[1, 2]], greedy)
    weights = tiny["qwen2"][1]
    with pytest.raises(ValueError, match="rollout.pp=1"):
        NativeRollout(shape, CPU).set_weights(
            RolloutWeights(weights.params, 1, 0, None, None, 0, 1, pp_size=2)
        )
    empty = engine.generate([], greedy)
    assert empty.response_ids.shape == (0, 8) and empty.finish_reasons == []


class EagerGraphs:
    """DecodeGraphs' contract without CUDA: warm-up with the capture position, then run the step eagerly over
    the whole cache, as a replay would (filler slots, buckets and the scratch row all exercised on CPU)."""

    num_graphs = 0

    def __init__(self):
        self.buckets = set()
        self.capture_seconds: dict[int, float] = {}

    def invalidate_unless(self, key) -> None:
        pass

    def clear(self) -> None:
        pass

    def run(self, bucket, step, prepare_capture, finish_capture):
        if bucket not in self.buckets:
            self.buckets.add(bucket)
            start = time.perf_counter()
            prepare_capture()
            step(bucket)  # the warm-up writes K/V at the last cache position
            finish_capture()
            self.capture_seconds[bucket] = time.perf_counter() - start
        return step(bucket)


def test_graph_mode_bookkeeping_equals_eager_on_cpu(tiny):
    """Bucketed widths, filler slots, compaction to smaller buckets and attention over the whole cache (what
    the CUDA graphs replay) give the eager engine's tokens."""
    prompts = random_prompts(tiny["llama"][0].vocab_size, lens=tuple(range(1, 21)), seed=7)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    eager = engine_for(tiny, "llama")
    free = eager.generate(prompts, greedy)
    stop = int(torch.bincount(free.response_ids.flatten()).argmax())
    with_stop = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=(stop,))
    ref = eager.generate(prompts, with_stop)
    graphed = engine_for(tiny, "llama", max_num_seqs=12)
    graphed.graphs = EagerGraphs()
    out = graphed.generate(prompts, with_stop)
    assert graphed.last_stats["compactions"] >= 1 and len(graphed.graphs.buckets) >= 2
    captured = graphed.graphs.capture_seconds  # each bucket's "capture" in this call, summed into capture_s
    assert set(captured) == graphed.graphs.buckets
    assert graphed.last_stats["capture_s"] == round(sum(captured.values()), 3) > 0
    assert torch.equal(out.response_ids, ref.response_ids) and out.finish_reasons == ref.finish_reasons
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("check_every", [1, 3])
def test_per_prompt_limits_stop_each_prompts_rows(tiny, check_every):
    """SamplingParams.max_new_tokens_per_prompt: every row of prompt p has exactly limit[p] tokens (EOS
    ignored), finish reason "length", and the tokens it has are the ones an unlimited run samples first
    (greedy); the batch is compacted as rows finish, and more chunks than one (max_num_seqs) work too."""
    prompts = random_prompts(tiny["qwen2"][0].vocab_size)
    limits = (7, 1, 3, 7, 2, 5)
    sampling = SamplingParams(n=2, temperature=0.0, max_new_tokens=7, ignore_eos=True)
    full = engine_for(tiny, "qwen2").generate(prompts, sampling)
    for max_num_seqs in (32, 4):
        engine = engine_for(tiny, "qwen2", max_num_seqs=max_num_seqs, check_every=check_every)
        out = engine.generate(
            prompts, SamplingParams(**{**sampling.__dict__, "max_new_tokens_per_prompt": limits})
        )
        lengths = out.response_mask.sum(-1).long().tolist()
        assert lengths == [x for x in limits for _ in range(2)], lengths
        assert out.finish_reasons == ["length"] * 12 and out.response_ids.shape == (12, 7)
        for row, length in enumerate(lengths):
            assert torch.equal(out.response_ids[row, :length], full.response_ids[row, :length]), row
            assert out.response_ids[row, length:].eq(0).all() and out.log_probs[row, length:].eq(0).all()
    with pytest.raises(ValueError, match=r"max_new_tokens_per_prompt must lie in \[1, max_new_tokens=7\]"):
        engine.generate(
            prompts, SamplingParams(max_new_tokens=7, max_new_tokens_per_prompt=(8, 1, 1, 1, 1, 1))
        )


@pytest.mark.parametrize("graphs,paged", [(False, True), (True, True), (False, False), (True, False)])
def test_freed_slots_admit_waiting_rows(tiny, graphs, paged):
    """More rows than slots, long-tailed per-row limits: rows waiting for a slot are admitted into the slots
    that finished rows free (while the long rows go on), not after the whole batch ends; every row's tokens
    are those of a run with all rows in one batch (greedy, float32: log-probs within 1e-5). Decode steps
    shrink from the sum over chunks of each chunk's longest row to about the longest row. With stop tokens
    (rows ending early, lengths unknown up front) the same holds. Both KV layouts (pages, and contiguous
    slots with their K/V copied at compaction)."""
    shape = tiny["qwen2"][0]
    prompts = random_prompts(shape.vocab_size, lens=tuple(range(3, 15)), seed=3)
    limits = (20, 2, 3, 2, 3, 2, 3, 2, 2, 4, 2, 3)
    sampling = SamplingParams(
        n=2, temperature=0.0, max_new_tokens=20, max_new_tokens_per_prompt=limits, ignore_eos=True
    )
    one_batch = engine_for(tiny, "qwen2").generate(prompts, sampling)
    engine = engine_for(tiny, "qwen2", max_num_seqs=6, check_every=1, paged_kv=paged or None)
    if graphs:
        engine.graphs = EagerGraphs()
    out = engine.generate(prompts, sampling)
    assert torch.equal(out.response_ids, one_batch.response_ids)
    assert torch.equal(out.response_mask, one_batch.response_mask)
    torch.testing.assert_close(out.log_probs, one_batch.log_probs, atol=1e-5, rtol=0)
    assert out.finish_reasons == ["length"] * 24
    rows = sorted((x for x in limits for _ in range(2)), reverse=True)
    chunked = sum(max(rows[i : i + 6]) - 1 for i in range(0, 24, 6))  # 19 + 2 + 1 + 1, one chunk at a time
    assert chunked == 23 and engine.last_stats["chunks"] > 4  # admissions beyond the first batch's
    assert engine.last_stats["decode_steps"] <= max(limits) + 1, (engine.last_stats, chunked)

    free = engine_for(tiny, "qwen2").generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    stop = int(torch.bincount(free.response_ids.flatten()).argmax())
    with_stop = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(stop,))
    ref = engine_for(tiny, "qwen2").generate(prompts, with_stop)
    out = engine.generate(prompts, with_stop)
    assert "stop" in ref.finish_reasons and engine.last_stats["chunks"] > 3
    assert torch.equal(out.response_ids, ref.response_ids) and out.finish_reasons == ref.finish_reasons
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)
    # rows whose only token comes from their prefill need no decode step
    ones = SamplingParams(temperature=0.0, max_new_tokens=1, max_new_tokens_per_prompt=(1,) * len(prompts))
    out = engine.generate(prompts, ones)
    assert engine.last_stats["decode_steps"] == 0 and out.response_mask.sum() == len(prompts)
    assert torch.equal(out.response_ids, ref.response_ids[:, :1])


def episode_turns(engine, prompts, first: SamplingParams, hold_len, seed: int = 0, temperature: float = 0.0):
    """Three turns as the episode loop runs them, inside `hold(hold_len)`: turn 1 generates `prompts`; each
    later turn continues a shuffled subset of the last turn's rows (one in three dropped) with 1-6 appended
    ids and its own per-row limits. Returns [(prompts, sampling, previous rows or None, output,
    engine.last_stats)] per turn."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.shape.vocab_size
    turns = []
    with engine.hold(hold_len):
        out = engine.generate(prompts, first)
        turns.append((prompts, first, None, out, dict(engine.last_stats)))
        for turn in (1, 2):
            rows = [r for r in torch.randperm(len(prompts), generator=g).tolist() if r % 3 != turn]
            lengths = out.response_mask.sum(-1).long().tolist()
            prompts = [
                prompts[r]
                + out.response_ids[r, : lengths[r]].tolist()
                + torch.randint(
                    0, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g
                ).tolist()
                for r in rows
            ]
            limits = tuple(torch.randint(2, 9, (len(rows),), generator=g).tolist())
            sampling = SamplingParams(
                temperature=temperature,
                max_new_tokens=max(limits),
                max_new_tokens_per_prompt=limits,
                stop_token_ids=first.stop_token_ids,
                seed=seed + turn,
            )
            out = engine.generate_continued(prompts, sampling, rows)
            turns.append((prompts, sampling, rows, out, dict(engine.last_stats)))
    return turns


@pytest.mark.parametrize("family,graphs", [("qwen2", False), ("qwen3", True)])
def test_continued_turns_keep_the_cache_and_equal_a_full_prefill(tiny, family, graphs):
    """Episode turns continued from the kept KV cache (rows moved to this call's padding, only the appended
    tokens prefilled) give the tokens of a full prefill of the same prompts, greedy, with log-probs within
    1e-5 (float32); mixed prompt, response and appended lengths, rows that finished early (compacted away
    in graph mode and eager), shuffled and dropped rows. Sampling with a seed repeats itself and draws what
    the full prefill draws. Without max_len the layout is too short for turn 2 and the engine prefills in
    full, and so does a turn after a call that needed more than one chunk; with keep_cache=False the cache is
    freed when the hold ends; a prompt that does not extend the row it names is an error."""
    shape = tiny[family][0]
    prompts = random_prompts(shape.vocab_size, lens=tuple(range(1, 13)), seed=3)
    free = engine_for(tiny, family).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    stop = int(torch.bincount(free.response_ids.flatten()).argmax())  # rows finish at different steps
    first = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,))
    hold_len = 12 + 3 * (8 + 6) + 8

    def engine(keep_episode_cache: bool = True):  # the same batch widths, hence random stream, for both
        e = engine_for(
            tiny,
            family,
            keep_cache=False,
            max_num_seqs=16 if graphs else 256,
            keep_episode_cache=keep_episode_cache,
        )
        if graphs:
            e.graphs = EagerGraphs()
        return e

    full = engine(keep_episode_cache=False)
    for temperature in (0.0, 1.0):
        kept = engine()
        turns = episode_turns(
            kept, prompts, replace(first, temperature=temperature), hold_len, 0, temperature
        )
        assert [t[4]["continued_rows"] for t in turns] == [0, len(turns[1][0]), len(turns[2][0])]
        assert turns[1][4]["compactions"] >= 1  # finished rows moved behind the live ones, then continued
        assert kept.pool.allocated_bytes() == 0 and kept._kept is None  # freed when the hold ended
        for p, sampling, _, out, _ in turns:
            ref = full.generate(p, sampling)
            assert (
                torch.equal(out.response_ids, ref.response_ids) and out.finish_reasons == ref.finish_reasons
            )
            torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)
        if temperature:
            again = episode_turns(
                engine(), prompts, replace(first, temperature=temperature), hold_len, 0, 1.0
            )
            for a, b in zip(turns, again):
                assert torch.equal(a[3].response_ids, b[3].response_ids)
        else:
            assert any(r == "stop" for r in turns[0][3].finish_reasons)
    with kept.hold(hold_len):
        kept.generate(prompts[:2], first)
        with pytest.raises(ValueError, match="prompt 0 does not start with row 1's prompt and response"):
            kept.generate_continued([prompts[0] + [1]], first, [1])
    short = engine()  # no max_len: turn 2 needs a longer cache than turn 1 laid out
    turns = episode_turns(short, prompts, first, None)
    assert turns[1][4]["continued_rows"] == 0
    for p, sampling, _, out, _ in turns:
        assert torch.equal(out.response_ids, full.generate(p, sampling).response_ids)
    # 12 rows in chunks of 8 keep nothing (turn 2 prefills in full); turn 2's 8 rows fit: turn 3 continues
    chunked = engine_for(tiny, family, max_num_seqs=8)
    turns = episode_turns(chunked, prompts, first, hold_len)
    assert [t[4]["continued_rows"] for t in turns] == [0, 0, len(turns[2][0])]
    for p, sampling, _, out, _ in turns:
        assert torch.equal(out.response_ids, full.generate(p, sampling).response_ids)
