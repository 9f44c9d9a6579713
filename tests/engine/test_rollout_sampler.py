"""Pure pieces of the rollout engines, no model: the sampler on hand-made logits, CUDA-graph batch buckets, the
KV cache pool and its compaction, the choice of decode attention kernel. World size: none."""

from __future__ import annotations

import math

import pytest
import torch

from engine.rollout.attention_kernels import DecodeKernels, decode_attention_kernel
from engine.rollout.base import MIN_TEMPERATURE, SamplingParams, check_sampling
from engine.rollout.cuda_graphs import batch_buckets, bucket_for
from engine.rollout.kv_cache import KVCachePool, compact_rows
from engine.rollout.sampler import _draw, _scaled_lse_probs, sample_tokens

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 at temperature 1
PROBS = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
ROWS = 4000


def draw(sampling: SamplingParams, probs=PROBS, seed: int = 0):
    logits = probs.log().expand(ROWS, -1).contiguous()
    return sample_tokens(logits, sampling, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "top_k, top_p, support",
    [
        (0, 1.0, {0, 1, 2, 3, 4}),
        (2, 1.0, {0, 1}),
        (1, 1.0, {0}),
        (0, 0.5, {0}),  # token 0 alone reaches 0.5
        (0, 0.7, {0, 1}),
        (0, 0.8, {0, 1, 2}),
        (3, 0.6, {0, 1}),  # top-k first, then the nucleus of what is left
        (10, 1.0, {0, 1, 2, 3, 4}),  # k beyond the vocabulary is off
    ],
)
def test_top_k_top_p_restrict_the_support_and_keep_full_vocab_log_probs(top_k, top_p, support):
    tokens, logp = draw(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p))
    assert set(tokens.tolist()) == support
    torch.testing.assert_close(logp, PROBS.log()[tokens], atol=1e-6, rtol=0)
    # renormalised frequencies inside the support
    kept = PROBS[sorted(support)] / PROBS[sorted(support)].sum()
    freq = torch.bincount(tokens, minlength=5)[sorted(support)].float() / ROWS
    assert (freq - kept).abs().max() < 0.03


@pytest.mark.parametrize("top_p", [1.0, 0.85])
def test_top_k_keeps_the_tokens_tied_with_the_kth(top_p):
    """Logits tied at the k-th largest value all stay candidates, as transformers' TopKLogitsWarper and vLLM
    keep them (bf16 logits tie often): top_k=3 over [0.4, 0.2, 0.1, 0.1, 0.1, 0.1] keeps six tokens, top_k=1
    over a tied maximum draws either (topk's order used to keep exactly k: one fixed id of the ties)."""
    probs = torch.tensor([0.4, 0.2, 0.1, 0.1, 0.1, 0.1])
    tokens, _ = draw(SamplingParams(temperature=1.0, top_k=3, top_p=top_p), probs)
    freq = torch.bincount(tokens, minlength=6).float() / ROWS
    if top_p == 1.0:
        assert (freq - probs).abs().max() < 0.03, freq
    else:  # the nucleus (0.85) ends inside the ties: three of the four tied tokens stay, whichever sorts first
        kept = torch.tensor([0.4, 0.2, 0.3]) / 0.9
        assert (torch.stack([freq[0], freq[1], freq[2:].sum()]) - kept).abs().max() < 0.03, freq
        assert int((freq[2:] > 0).sum()) == 3, freq
    tied = torch.tensor([0.4, 0.4, 0.2])
    tokens, _ = draw(SamplingParams(temperature=1.0, top_k=1, top_p=top_p), tied)
    assert abs(float((tokens == 0).float().mean()) - 0.5) < 0.03 and set(tokens.tolist()) == {0, 1}


def test_temperature_scales_the_distribution_and_the_log_probs():
    t = 0.5
    tokens, logp = draw(SamplingParams(temperature=t))
    sharpened = (PROBS.log() / t).log_softmax(-1)
    torch.testing.assert_close(logp, sharpened[tokens], atol=1e-6, rtol=0)
    freq = torch.bincount(tokens, minlength=5).float() / ROWS
    assert (freq - sharpened.exp()).abs().max() < 0.03


@pytest.mark.parametrize("top_k, top_p", [(0, 0.8), (3, 1.0), (3, 0.8)])
def test_truncated_draws_at_a_temperature_keep_full_vocab_log_probs(top_k, top_p):
    """The log-prob of a token drawn under top-k/top-p at T != 1 is log_softmax(logits / T) over the whole
    vocabulary, as the training forward computes it (not the truncated, renormalised distribution's)."""
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(1)) * 3
    sampling = SamplingParams(temperature=0.6, top_k=top_k, top_p=top_p)
    tokens, logp = sample_tokens(logits, sampling, torch.Generator().manual_seed(0))
    full = (logits / 0.6).log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, full, atol=1e-5, rtol=0)


def test_greedy_takes_the_argmax_with_temperature_one_log_probs():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 2.5]])
    tokens, logp = sample_tokens(logits, SamplingParams(temperature=0.0), torch.Generator())
    assert tokens.tolist() == [1, 2]
    torch.testing.assert_close(logp, logits.log_softmax(-1)[[0, 1], [1, 2]])


def test_draws_across_vocabulary_blocks_follow_the_distribution():
    """A 600-token vocabulary (3 blocks of the two-level draw, the last one short), mass on block edges and
    whole blocks at zero probability: frequencies match, zero-probability tokens never come out."""
    probs = torch.zeros(600)
    support = [5, 255, 256, 511, 599]
    probs[support] = torch.tensor([0.3, 0.2, 0.2, 0.2, 0.1])
    tokens, logp = draw(SamplingParams(temperature=1.0), probs=probs)
    assert set(tokens.tolist()) <= set(support)
    freq = torch.bincount(tokens, minlength=600)[support].float() / ROWS
    assert (freq - probs[support]).abs().max() < 0.03
    torch.testing.assert_close(logp, probs.log()[tokens], atol=1e-6, rtol=0)


def test_two_level_draw_equals_the_flat_inverse_cdf():
    """Same uniform numbers: the block-then-token search picks the token one cumulative sum over the whole
    vocabulary picks (up to float rounding at a boundary: >= 99.9% of 2000 rows of 5000 random weights)."""
    g = torch.Generator().manual_seed(3)
    weights = torch.rand(2000, 5000, generator=g).pow(8)
    weights[:, 1000:1600] = 0.0
    tokens = _draw(weights, torch.Generator().manual_seed(7))
    u = 1.0 - torch.rand(2000, 1, generator=torch.Generator().manual_seed(7))
    cdf = weights.double().cumsum(-1)
    flat = torch.searchsorted(cdf, u.double() * cdf[:, -1:]).squeeze(-1)
    assert (tokens == flat).float().mean() >= 0.999
    assert bool((weights.gather(1, tokens[:, None]) > 0).all())


def test_seeded_draws_repeat_and_differ_across_seeds():
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    a, b, c = draw(sampling, seed=1)[0], draw(sampling, seed=1)[0], draw(sampling, seed=2)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("max_new_tokens", 0),
        ("temperature", -1.0),
        ("temperature", 1e-40),
        ("top_p", 1.5),
        ("top_k", -1),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}=.*rollout.{field}"):
        check_sampling(SamplingParams(**{field: value}))


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (2, 1.0), (0, 0.99)])
def test_the_smallest_temperature_samples_without_nan(top_k, top_p):
    """At MIN_TEMPERATURE float32 logits far beyond any model's (1e30) stay finite once scaled, and the draw is
    still a draw: two logits 0.01 apart (probabilities 1 : e) both come up, with finite log-probs. At 1e-40
    (the bound's reason) 1 / T overflows float32 and the probabilities are NaN."""
    logits = torch.tensor([0.0, 0.01, -1e30, 1e-3 - 1.0]).expand(ROWS, -1).contiguous()  # float32
    sampling = SamplingParams(temperature=MIN_TEMPERATURE, top_k=top_k, top_p=top_p)
    check_sampling(sampling)
    tokens, logp = sample_tokens(logits, sampling, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1} and bool(logp.isfinite().all())
    expected = torch.tensor([0.0, 1.0]) - math.log(1 + math.e)  # log(1 : e), the others ~e^-100 and below
    torch.testing.assert_close(logp, expected[tokens], atol=1e-5, rtol=0)
    freq = torch.bincount(tokens, minlength=2)[1].item() / ROWS
    assert abs(freq - math.e / (1 + math.e)) < 0.03
    huge = torch.tensor([[1e30, -1e30, 0.0]])
    assert bool(_scaled_lse_probs(huge, 1.0 / MIN_TEMPERATURE)[2].isfinite().all())
    assert bool(_scaled_lse_probs(huge, 1.0 / 1e-40)[2].isnan().any())


def test_graph_buckets_cover_every_width_with_at_most_half_padding():
    for slots in (1, 3, 7, 64, 100, 512):
        buckets = batch_buckets(slots)
        assert buckets[-1] == slots and buckets == sorted(set(buckets))
        assert len(buckets) <= 2 * math.log2(slots) + 3
        for width in range(1, slots + 1):
            b = bucket_for(width, buckets)
            assert width <= b <= max(4, math.ceil(1.5 * width), width)
    with pytest.raises(ValueError, match="exceed"):
        bucket_for(9, batch_buckets(8))


def test_kv_pool_budget_views_growth_and_compaction():
    pool = KVCachePool(num_layers=2, groups=3, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    per_seq = pool.bytes_per_sequence(10)
    assert per_seq == 2 * 2 * 3 * 10 * 4 * 4
    pool = KVCachePool(2, 3, 4, torch.float32, torch.device("cpu"), budget_bytes=5 * per_seq + 7)
    assert pool.max_slots(10) == 5
    k, v = pool.views(4, 10)
    assert len(k) == 2 and k[0].shape == (4, 10, 3, 4) and k[0].is_contiguous()
    assert all(t.eq(0).all() for t in (*k, *v)), "a new buffer is zeroed (0 * NaN would poison attention)"
    version = pool.version
    pool.views(2, 10)  # fits: same storage, same version
    assert pool.version == version
    pool.views(5, 10)
    assert pool.version == version + 1 and pool.allocated_bytes() == 5 * per_seq
    k, v = pool.views(5, 10)
    for i, t in enumerate((*k, *v)):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + 1000 * i)
    before = [t.clone() for t in (*k, *v)]
    compact_rows(k, v, torch.tensor([1, 3, 4]), num_positions=6)
    for t, old in zip((*k, *v), before):
        assert torch.equal(t[:3, :6], old[[1, 3, 4], :6])
        assert torch.equal(t[:, 6:], old[:, 6:])  # unwritten positions are not copied
    pool.release()
    assert pool.allocated_bytes() == 0


def test_decode_attention_kernel_choice_and_errors():
    """auto picks the first kernel that runs here (CPU: sdpa); a named kernel that cannot run is an error."""
    cpu = torch.device("cpu")
    assert decode_attention_kernel("auto", cpu, torch.bfloat16, 128, 7) == "sdpa"
    assert decode_attention_kernel("sdpa", cpu, torch.float32, 16, 2) == "sdpa"
    for name in ("triton", "flash"):
        with pytest.raises(ValueError, match=f"kernel '{name}' cannot run on cpu.*use 'auto'"):
            decode_attention_kernel(name, cpu, torch.bfloat16, 128, 7)
    with pytest.raises(ValueError, match="pick one of auto, triton, flash, sdpa"):
        decode_attention_kernel("paged", cpu, torch.bfloat16, 128, 7)


@pytest.mark.parametrize("tiles", [(48, 4, 2), (64, 3, 2), (64, 4, 0), (8, 4, 2), (64, 2), (64, 4, 2, 300)])
def test_bad_attention_tiles_name_the_field(tiles):
    with pytest.raises(
        ValueError, match=r"DecodeKernels.attention_tiles=.*expected \(key block: a power of two"
    ):
        DecodeKernels(attention_tiles=tiles)
    tiles = DecodeKernels(attention_tiles=(128, 2, 3), attention_occupancy=False).attention_knobs()
    assert tiles == {"block_n": 128, "num_warps": 2, "num_stages": 3}
    assert DecodeKernels().attention_knobs() == {"occupancy": True}  # each launch's cap: the default
    assert DecodeKernels(attention_occupancy=False).attention_knobs() == {}
    capped = DecodeKernels(attention_tiles=(64, 4, 2, 120)).attention_knobs()  # a named cap: every launch's
    assert capped == {"block_n": 64, "num_warps": 4, "num_stages": 2, "max_registers": 120}
    tiled = DecodeKernels(attention_tiles=(64, 4, 2)).attention_knobs()
    assert tiled == {"block_n": 64, "num_warps": 4, "num_stages": 2, "occupancy": True}
