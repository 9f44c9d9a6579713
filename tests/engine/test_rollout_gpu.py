"""The native rollout engine on CUDA (marked `gpu`, skipped on CPU): transformers parity with CUDA-graph decode,
graph replay == eager decode, graphs vs eager end to end (stops, compaction, several buckets), the KV cache
budget from free memory and its release. World size: none (in-process, one GPU), except the last test: 2
GPUs, NCCL, tests/engine/rollout_tp_script.py with `cuda` (rollout.tp 2 and 1 on real training shards).
The attention and RoPE/K-V kernels alone: tests/engine/test_decode_kernels_gpu.py.

Tolerances: float32 log-probs within 2e-4 of transformers; in bfloat16 the fast kernels (Triton or flash
decode attention, compiled elementwise chains) stay within 1.5x the plain path's distance to a float32
forward (the flash prefill the same against the masked one; samples reading their prompt from one copy the same
against transformers); graph replay equals eager decode bitwise (same kernels, same inputs); graphs vs eager
generation (which attends over cur + 1 keys instead of the whole cache) within 1e-4 in float32; episode turns continued from the kept KV cache equal a full prefill in
float32 (tokens exact, log-probs within 1e-4).
"""

from __future__ import annotations

from pathlib import Path

import hf_tiny
import pytest
import torch
from distributed import run_torchrun
from test_rollout_native import (
    episode_turns,
    hf_greedy,
    hf_log_probs,
    largest_log_prob_error,
    random_prompts,
    rollout_weights_from_hf,
)

from engine.rollout.base import SamplingParams
from engine.rollout.cuda_graphs import DecodeGraphs
from engine.rollout.kv_cache import KVCachePool
from engine.rollout.model import DecodeKernels, RolloutModel
from engine.rollout.native import NativeRollout
from engine.rollout.rope import rope_tables
from parallel.rollout_weights import RolloutWeights

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
FAMILIES = ("qwen2", "llama")


def on_gpu(weights: RolloutWeights, dtype=None) -> RolloutWeights:
    return RolloutWeights({k: v.to(DEV, dtype) for k, v in weights.params.items()}, 1, 0, None, None, 0, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("rollout_gpu_hf")
    out = {}
    for i, family in enumerate(FAMILIES):  # rows of several 64-position pages
        path = hf_tiny.save_tiny(family, str(root / family), seed=i, max_position_embeddings=512)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        shape, weights = rollout_weights_from_hf(path)
        out[family] = (shape, weights, hf)
    return out


def engine(tiny, family, dtype=None, **kw) -> NativeRollout:
    shape, weights, _ = tiny[family]
    e = NativeRollout(shape, DEV, pad_id=kw.pop("pad_id", 0), **kw)
    e.set_weights(on_gpu(weights, dtype))
    return e


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_with_cuda_graphs(tiny, family):
    shape, _, hf = tiny[family]
    e = engine(tiny, family, max_num_seqs=4)
    prompts = random_prompts(shape.vocab_size)
    out = e.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert e.last_stats["graphs"] >= 1 and e.pool.allocated_bytes() == 0  # released after the call
    captured = dict(e.graphs.capture_seconds)  # this call's captures, timed
    assert len(captured) == e.last_stats["graphs"] and min(captured.values()) > 0
    assert e.last_stats["capture_s"] == round(sum(captured.values()), 3)
    e.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2))
    assert set(e.graphs.capture_seconds) == {1}  # the next call's alone
    for i, prompt in enumerate(prompts):
        tokens, logp = hf_greedy(hf, prompt, 12)
        assert out.response_ids[i].tolist() == tokens, (family, i)
        torch.testing.assert_close(out.log_probs[i], logp, atol=2e-4, rtol=0)


def test_sampled_log_probs_with_the_triton_draw_equal_transformers(tiny):
    """Temperature 0.7 through the engine's default kernels (the Triton draw on the graphs' logits)
    in float32: each drawn token's log-prob equals transformers' teacher-forced log_softmax(logits / T) within
    2e-4; the torch draw (`DecodeKernels(sampler=False)`) on the same engine shape passes the same check."""
    shape, _, hf = tiny["qwen2"]
    prompts = random_prompts(shape.vocab_size)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=12, seed=3)
    for kernels in (DecodeKernels(), DecodeKernels(sampler=False)):
        e = engine(tiny, "qwen2", kernels=kernels)
        assert e.fused_draw == kernels.sampler
        out = e.generate(prompts, sampling)
        for i, prompt in enumerate(prompts):
            ref = hf_log_probs(hf, prompt, out.response_ids[i].tolist(), 0.7)
            torch.testing.assert_close(out.log_probs[i].cpu(), ref, atol=2e-4, rtol=0)


def test_triton_draw_at_a_real_vocabulary():
    """engine/rollout/triton_sample.py on bf16 logits of Qwen2.5's 151,936 columns (a padded head's strided
    view), 8,192 rows of one peaked distribution at temperature 0.8: the top 16 tokens' counts and the rest's
    against softmax(logits / T) (chi-square, 16 degrees of freedom, below the 0.1% point 39.25), log-probs equal
    log_softmax in float32 within 1e-4, and at 8 rows (each row cut into chunks) the same checks on the draws
    of 1,024 seeds; a token with all the mass is every row's draw."""
    from engine.rollout import triton_sample

    g = torch.Generator(device=DEV).manual_seed(0)
    vocab, t = 151_936, 0.8
    row = (torch.randn(vocab, generator=g, device=DEV) * 2.5).to(torch.bfloat16)
    full = (row.float() / t).log_softmax(-1)
    top = full.topk(16).indices
    probs = torch.cat((full[top].exp(), (1 - full[top].exp().sum())[None]))

    def counts(tokens):
        hit = tokens[:, None] == top[None]
        return torch.cat((hit.sum(0), (~hit.any(1)).sum()[None])).double()

    for rows, seeds in ((8192, 1), (8, 1024)):
        padded = row.expand(rows, -1).contiguous()
        padded = torch.cat((padded, padded[:, :64]), 1)[:, :vocab]
        observed = torch.zeros(17, dtype=torch.float64, device=DEV)
        for seed in range(seeds):
            tokens, logp = triton_sample.sample(padded, 1 / t, torch.Generator(device=DEV).manual_seed(seed))
            torch.testing.assert_close(logp, full[tokens], atol=1e-4, rtol=0)
            observed += counts(tokens)
        expected = probs.double() * rows * seeds
        assert float(((observed - expected) ** 2 / expected).sum()) < 39.25, (observed, expected)
    # a token with all the mass (its logit 40 above the rest: e^-40 for every other) is the draw of every row:
    # the rest's mass (< 1e-12) lies far below the smallest target 1 - u can set (2^-24 of the row's mass)
    peaked = torch.zeros(8192, vocab, dtype=torch.bfloat16, device=DEV)
    peaked[:, 12345] = 40.0
    for seed in range(4):
        tokens, logp = triton_sample.sample(peaked, 1.0, torch.Generator(device=DEV).manual_seed(seed))
        assert bool((tokens == 12345).all()) and float(logp.abs().max()) < 1e-5


def test_graph_replay_equals_eager_decode_bitwise(tiny):
    shape, weights, _ = tiny["llama"]
    w = on_gpu(weights, torch.bfloat16)
    model = RolloutModel(shape, w, rope_tables(shape, DEV, torch.bfloat16))
    rows, plen, seq_len = 6, 9, 32
    pool = KVCachePool(
        shape.num_layers, model.groups, model.head_dim, torch.bfloat16, DEV, budget_bytes=1 << 26
    )
    k, v = pool.views(rows, seq_len)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab_size, (rows, plen), generator=g).to(DEV)
    pad = torch.tensor([0, 3, 8, 1, 0, 5], device=DEV)
    logits = model.prefill(ids, pad, k, v, torch.arange(rows, device=DEV))
    tokens, cur = logits.argmax(-1), torch.tensor([plen], device=DEV)
    graphs = DecodeGraphs(DEV)

    def step(b: int) -> torch.Tensor:
        return model.decode(tokens[:b], pad[:b], cur, [t[:b] for t in k], [t[:b] for t in v], seq_len)

    for _ in range(3):  # successive decode steps: same inputs through eager and through the graph
        k_eager, v_eager = [t.clone() for t in k], [t.clone() for t in v]
        eager = model.decode(tokens, pad, cur, k_eager, v_eager, seq_len)
        saved = int(cur)
        replayed = graphs.run(
            rows, step, lambda c=cur: c.fill_(seq_len - 1), lambda c=cur, s=saved: c.fill_(s)
        )
        assert torch.equal(replayed, eager)
        assert all(torch.equal(a[:, : saved + 1], b[:, : saved + 1]) for a, b in zip(k, k_eager))
        tokens.copy_(replayed.argmax(-1))
        cur.add_(1)
    assert graphs.num_graphs == 1


def teacher_forced_logits(shape, weights, dtype, kernels, ids, pad, steps: int) -> torch.Tensor:
    """Prefill left-padded `ids`, then `steps` decode steps fed tokens[t] = (t * 7 + row) % vocab: the
    logits of every step, (steps + 1, rows, vocab) float32."""
    model = RolloutModel(shape, on_gpu(weights, dtype), rope_tables(shape, DEV, dtype), kernels)
    rows, plen = ids.shape
    pool = KVCachePool(shape.num_layers, model.groups, model.head_dim, dtype, DEV, budget_bytes=1 << 26)
    k, v = pool.views(rows, plen + steps)
    out = [model.prefill(ids, pad, k, v, torch.arange(rows, device=DEV))]
    for t in range(steps):
        tokens = (t * 7 + torch.arange(rows, device=DEV)) % shape.vocab_size
        cur = torch.tensor([plen + t], device=DEV)
        out.append(model.decode(tokens, pad, cur, k, v, plen + t + 1))
    return torch.stack(out)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["triton", "flash"])
def test_fast_kernels_match_the_plain_path_in_bf16(tiny, family, attention):
    shape, weights, _ = tiny[family]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape.vocab_size, (6, 11), generator=g).to(DEV)
    pad = torch.tensor([0, 4, 10, 1, 0, 7], device=DEV)
    plain = DecodeKernels(attention="sdpa", compiled=False)
    auto = RolloutModel(shape, on_gpu(weights, torch.bfloat16), rope_tables(shape, DEV, torch.bfloat16))
    assert auto.attention == "triton", "the Triton decode kernel should run bf16 decode attention here"
    ref = teacher_forced_logits(shape, weights, torch.float32, plain, ids, pad, 20)
    slow = teacher_forced_logits(shape, weights, torch.bfloat16, plain, ids, pad, 20)
    fast = teacher_forced_logits(shape, weights, torch.bfloat16, DecodeKernels(attention), ids, pad, 20)
    err_slow, err_fast = (slow - ref).abs(), (fast - ref).abs()
    assert err_fast.max() <= 1.5 * err_slow.max() + 1e-3, (float(err_fast.max()), float(err_slow.max()))
    assert err_fast.mean() <= 1.5 * err_slow.mean() + 1e-4, (float(err_fast.mean()), float(err_slow.mean()))
    assert (fast.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("pad", [[0, 4, 10, 1, 0, 7], [3, 0, 9, 0, 5, 10]])
def test_flash_prefill_matches_the_masked_prefill_in_bf16(tiny, pad):
    """FlashAttention-2 varlen prefill (the fast kernels' default) against the masked SDPA prefill, both bf16,
    distance to a float32 masked prefill: logits and every layer's K/V at the real positions."""
    shape, weights, _ = tiny["qwen2"]
    rows, plen = len(pad), 11
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, shape.vocab_size, (rows, plen), generator=g).to(DEV)
    pad_t = torch.tensor(pad, device=DEV)
    out = {}
    for name, dtype, kernels in (
        ("ref", torch.float32, DecodeKernels(attention="sdpa", compiled=False)),
        ("sdpa", torch.bfloat16, DecodeKernels(attention="sdpa", compiled=False)),
        ("flash", torch.bfloat16, DecodeKernels(compiled=False)),  # (no compiles: other tests count them)
    ):
        model = RolloutModel(shape, on_gpu(weights, dtype), rope_tables(shape, DEV, dtype), kernels)
        assert model.prefill_flash == (name == "flash")
        pool = KVCachePool(shape.num_layers, model.groups, model.head_dim, dtype, DEV, budget_bytes=1 << 24)
        k, v = pool.views(rows, plen)
        logits = model.prefill(ids, pad_t, k, v, torch.arange(rows, device=DEV))
        real = [torch.cat([t[r, p:].float().flatten() for r, p in enumerate(pad)]) for t in k + v]
        out[name] = (logits.float(), torch.stack(real))
    for i in range(2):
        err_sdpa = (out["sdpa"][i] - out["ref"][i]).abs()
        err_flash = (out["flash"][i] - out["ref"][i]).abs()
        assert err_flash.max() <= 1.5 * err_sdpa.max() + 1e-3, (
            i,
            float(err_flash.max()),
            float(err_sdpa.max()),
        )
        assert err_flash.mean() <= 1.5 * err_sdpa.mean() + 1e-4, (
            i,
            float(err_flash.mean()),
            float(err_sdpa.mean()),
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_decode_kernels_match_the_unfused_ones(tiny, family):
    """Teacher-forced decode logits (bf16, Triton attention) with RoPE and the K/V writes inside the attention
    kernel and the MLP as two Triton kernels (the default), and with RoPE/K-V as their own Triton kernel,
    against the compiled RoPE, indexed writes, compiled merge and cuBLAS MLP they replace: each fused path's
    distance to the float32 plain path within 1.5x the unfused path's (max and mean), and the same argmax nearly
    everywhere. (Not fused against unfused directly: the new key attended from registers rounds its softmax
    weight at another point than `tl.dot`'s block does, and 20 steps of a random model carry such bf16
    differences past a fixed tolerance.)"""
    shape, weights, _ = tiny[family]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, shape.vocab_size, (6, 11), generator=g).to(DEV)
    pad = torch.tensor([0, 4, 10, 1, 0, 7], device=DEV)
    model = RolloutModel(shape, on_gpu(weights, torch.bfloat16), rope_tables(shape, DEV, torch.bfloat16))
    assert model.fused_rope_kv and model.rope_in_attention, "the fused RoPE/K-V paths should run here"
    assert model.triton_mlp, "the narrow steps' MLP should run as engine/rollout/triton_mlp.py's kernels"
    ref = teacher_forced_logits(
        shape, weights, torch.float32, DecodeKernels(attention="sdpa", compiled=False), ids, pad, 20
    )
    unfused = teacher_forced_logits(
        shape, weights, torch.bfloat16, DecodeKernels("triton", fused=False, mlp=False), ids, pad, 20
    )
    err_unfused = (unfused - ref).abs()
    for kernels in (DecodeKernels("triton"), DecodeKernels("triton", rope_in_attention=False)):
        fused = teacher_forced_logits(shape, weights, torch.bfloat16, kernels, ids, pad, 20)
        err = (fused - ref).abs()
        assert err.max() <= 1.5 * err_unfused.max() + 1e-3, (
            kernels,
            float(err.max()),
            float(err_unfused.max()),
        )
        assert err.mean() <= 1.5 * err_unfused.mean() + 1e-4, (
            kernels,
            float(err.mean()),
            float(err_unfused.mean()),
        )
        assert (fused.argmax(-1) == unfused.argmax(-1)).float().mean() >= 0.95


def test_paged_generation_with_graphs_equals_the_contiguous_layout(tiny):
    """Long-tailed per-row limits with CUDA graphs: pages where the budget holds every row give the
    contiguous layout's tokens and log-probs bit for bit in bf16 (the Triton kernel through the table);
    a budget of two whole rows preempts and resumes rows (rows that outgrow their pages; admission does not
    read per-row limits) and still gives an unconstrained run's tokens in float32 (log-probs within 1e-4)."""
    shape = tiny["qwen2"][0]
    prompts = random_prompts(shape.vocab_size, lens=tuple(range(3, 27)), seed=4)
    limits = tuple([40, 3, 2, 5, 2, 30, 3, 2, 6, 2, 3, 2] * 2)
    sampling = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, max_new_tokens_per_prompt=limits)
    flat = engine(tiny, "qwen2", torch.bfloat16, paged_kv=False).generate(prompts, sampling)
    paged_engine = engine(tiny, "qwen2", torch.bfloat16, paged_kv=True)
    paged = paged_engine.generate(prompts, sampling)
    assert paged_engine.last_stats["paged"] and paged_engine.last_stats["graphs"] >= 2
    assert torch.equal(flat.response_ids, paged.response_ids) and torch.equal(flat.log_probs, paged.log_probs)
    long_rows = tuple([200, 150, 3, 120, 2, 180] * 4)  # rows that outgrow what admission set aside
    long = SamplingParams(temperature=0.0, max_new_tokens=200, max_new_tokens_per_prompt=long_rows)
    ref_engine = engine(tiny, "qwen2")
    ref = ref_engine.generate(prompts, long)
    per_page = ref_engine.pool.bytes_per_sequence(64)  # float32; rows of 26 + 200 positions: 4 pages
    tight = engine(tiny, "qwen2", kv_cache_budget_bytes=9 * per_page, max_num_seqs=16)
    out = tight.generate(prompts, long)
    assert tight.last_stats["preemptions"] >= 1 and tight.last_stats["graphs"] >= 1, tight.last_stats
    assert torch.equal(out.response_ids, ref.response_ids) and out.finish_reasons == ref.finish_reasons
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("paged", [False, True])
def test_shared_prompt_log_probs_match_transformers_as_reading_each_rows_own_prompt(tiny, paged):
    """Four samples per prompt at temperature 1 with stop tokens and per-prompt limits (rows finish at different
    steps, compactions, admissions into freed slots), bf16, CUDA graphs: with each row reading its prompt from
    its group's first live row (at every width: `shared_prefix_min_rows=1`) the sampled tokens' log-probs stay
    within 1.5x the distance of every row reading its own copy to transformers' float32 teacher-forced
    log-probs."""
    shape, _, hf = tiny["qwen2"]
    prompts = random_prompts(shape.vocab_size, lens=tuple(range(60, 84)), seed=9)
    sampling = SamplingParams(
        n=4,
        temperature=1.0,
        max_new_tokens=48,
        max_new_tokens_per_prompt=tuple([48, 5, 30, 12] * 6),
        stop_token_ids=tuple(range(0, shape.vocab_size, 40)),
        seed=11,
    )
    errors = []
    for shared in (True, False):
        kernels = DecodeKernels(shared_prefix=shared, shared_prefix_min_rows=1)
        # host checks every step: the batch narrows as rows finish, whatever the sampled trajectory (every 8
        # steps, a trajectory whose last rows all finished between two checks once never narrowed)
        e = engine(
            tiny, "qwen2", torch.bfloat16, paged_kv=paged, max_num_seqs=32, kernels=kernels, check_every=1
        )
        out = e.generate(prompts, sampling)
        # the widths captured in the call (the stats' `graphs`: the graphs held at its end)
        captured = len(e.graphs.capture_seconds)
        assert e.model.shared_prefix == shared and captured >= 2, (captured, e.last_stats)
        assert e.last_stats["chunks"] > 1 and bool(e.last_stats["paged"]) == paged, e.last_stats
        assert {"stop", "length"} <= set(out.finish_reasons)
        errors.append(largest_log_prob_error(hf, prompts, sampling.n, out))
    assert errors[0] <= 1.5 * errors[1] + 1e-3, errors


def test_split_merge_compiles_once_for_every_width_and_split_count():
    """(`DecodeKernels(fused=False)`: the Triton merge replaces it by default.) The compiled merge of split key ranges is not recompiled when the batch width or the split count
    changes (each recompile cost ~2 s inside a rollout: three of them at the widths where the split count
    first moved made the long-tail rollout bench 25% slower at 1.5B, measured on an H200)."""
    from engine.rollout import triton_decode

    g = torch.Generator(device=DEV).manual_seed(0)

    def run(rows, splits):
        q = torch.randn(rows, 2, 7, 128, device=DEV, generator=g).bfloat16()
        k, v = (torch.randn(rows, 1024, 2, 128, device=DEV, generator=g).bfloat16() for _ in range(2))
        pad, cur = torch.zeros(rows, dtype=torch.long, device=DEV), torch.tensor([1000], device=DEV)
        return triton_decode.decode_attention(q, k, v, pad, cur, splits=splits, triton_merge=False)

    run(8, 2)  # compiles (or recompiles once, if an earlier test compiled it for fixed sizes)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows, splits in ((8, 3), (24, 2), (96, 5), (3, 4)):
            assert run(rows, splits).shape == (rows, 2, 7, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphs_and_eager_generate_the_same(tiny, dtype):
    shape = tiny["llama"][0]
    prompts = random_prompts(shape.vocab_size, lens=tuple(range(1, 25)), seed=5)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    free = engine(tiny, "llama", dtype, cuda_graphs=False).generate(prompts, greedy)
    stop = int(torch.bincount(free.response_ids.flatten()).argmax())
    with_stop = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(stop,))
    graphed_engine = engine(tiny, "llama", dtype, check_every=1)
    graphed = graphed_engine.generate(prompts, with_stop)
    eager = engine(tiny, "llama", dtype, cuda_graphs=False, check_every=1).generate(prompts, with_stop)
    assert graphed_engine.last_stats["graphs"] >= 2 and graphed_engine.last_stats["compactions"] >= 1
    if dtype == torch.float32:
        assert torch.equal(graphed.response_ids, eager.response_ids)
        torch.testing.assert_close(graphed.log_probs, eager.log_probs, atol=1e-4, rtol=0)
        assert graphed.finish_reasons == eager.finish_reasons
    else:  # bf16: flash decode reads the same keys in both, so only compiled-kernel scheduling could differ
        assert torch.equal(graphed.response_ids[:, 0], eager.response_ids[:, 0])  # from the same prefill
        assert (graphed.response_ids[:, :4] == eager.response_ids[:, :4]).all(-1).float().mean() >= 0.9
    sampled = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=9)
    assert torch.equal(
        graphed_engine.generate(prompts, sampled).response_ids,
        graphed_engine.generate(prompts, sampled).response_ids,
    )


def test_kv_budget_from_free_memory_chunks_and_is_released(tiny):
    shape = tiny["qwen2"][0]
    prompts = random_prompts(shape.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    default = engine(tiny, "qwen2")
    ref = default.generate(prompts, greedy)
    assert default.last_stats["chunks"] == 1 and default.pool.allocated_bytes() == 0
    per_seq = default.pool.bytes_per_sequence(64)  # 13 + 10 rounded up to 64 on CUDA
    small = engine(tiny, "qwen2", kv_cache_budget_bytes=2 * per_seq, keep_cache=True)
    out = small.generate(prompts, greedy)
    assert small.last_stats["slots"] == 2 and small.last_stats["chunks"] == 3
    assert small.pool.allocated_bytes() == 2 * per_seq
    assert torch.equal(out.response_ids, ref.response_ids)


def test_world2_nccl_rollout_tp2_and_tp1_with_cuda_graphs(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for i, family in enumerate(("qwen2", "llama")):
        hf_tiny.save_tiny(family, str(tmp_path / family), seed=i)
    script = str(Path(__file__).with_name("rollout_tp_script.py"))
    out = run_torchrun(script, 2, [str(tmp_path), "cuda"])
    assert out.count("RESULT {") == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_continued_turns_with_cuda_graphs(tiny, dtype):
    """Episode turns continued from the kept KV cache (CUDA graphs captured once for the held layout) equal a
    full prefill of the same prompts in float32; in bfloat16 (the fast decode kernels) they run from the
    cache with finite log-probs. The cache is freed when the hold ends."""
    shape = tiny["qwen2"][0]
    prompts = random_prompts(shape.vocab_size, lens=tuple(range(1, 13)), seed=3)
    free = engine(tiny, "qwen2", dtype).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    stop = int(torch.bincount(free.response_ids.flatten()).argmax())
    first = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,))
    kept = engine(tiny, "qwen2", dtype, max_num_seqs=16)
    turns = episode_turns(kept, prompts, first, 12 + 3 * (8 + 6) + 8)
    assert [t[4]["continued_rows"] for t in turns] == [0, len(turns[1][0]), len(turns[2][0])]
    assert kept.pool.allocated_bytes() == 0
    full = engine(tiny, "qwen2", dtype, max_num_seqs=16, keep_episode_cache=False)
    for p, sampling, _, out, _ in turns:
        assert torch.isfinite(out.log_probs).all()
        if dtype == torch.float32:
            ref = full.generate(p, sampling)
            assert torch.equal(out.response_ids, ref.response_ids)
            torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-4, rtol=0)
