"""The rollout's Triton kernels under Triton's interpreter (TRITON_INTERPRET=1) on the CPU, in float16, against
independent references: decode attention against SDPA in float32, the paged cache against the contiguous one,
the Triton split merge against `merge_splits`, the fused RoPE/K-V write against `apply_rope` and indexed writes,
the narrow MLP's two kernels against F.linear and SwiGLU in float32, and
the native engine's decode forward with them (engine/rollout/model.py picks them under the interpreter) against
its SDPA path and a float32 forward, on tiny Hugging Face checkpoints; the Triton draw. The update's kernels:
interpreted_training_kernels.py.

Not collected by the test run itself (the name does not start with test_): tests/engine/test_triton_cpu.py
runs this file in a subprocess with the interpreter switched on, which Triton reads when the kernels are
defined. The interpreter has no bfloat16 (it reads garbage), hence float16; the GPU runs the same cases in
bfloat16 in tests/engine/test_rollout_gpu.py. Sizes are small: the interpreter runs each program in numpy.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/engine/test_triton_cpu.py"

import hf_tiny  # noqa: E402
from test_rollout_native import rollout_weights_from_hf  # noqa: E402

from engine.rollout import triton_decode, triton_mlp, triton_rope_kv  # noqa: E402
from engine.rollout.kv_cache import KVCachePool  # noqa: E402
from engine.rollout.model import DecodeKernels, RolloutModel, add_partials_rms_norm, swiglu  # noqa: E402
from engine.rollout.rope import apply_rope, rope_tables, signed_sin  # noqa: E402
from parallel.rollout_weights import RolloutWeights  # noqa: E402

DT = torch.float16
ROWS, GROUPS, PER_GROUP, DIM = 5, 2, 7, 64  # Qwen2.5-7B's 7 query heads per KV group, a smaller head dim


def _inputs(cache_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(ROWS, GROUPS, PER_GROUP, DIM, generator=g).to(DT)
    k, v = (torch.randn(ROWS, cache_len, GROUPS, DIM, generator=g).to(DT) for _ in "kv")
    return q, k, v


def _sdpa(q, k, v, pad, cur):
    ar = torch.arange(k.shape[1])
    mask = ((ar >= pad[:, None]) & (ar <= cur.expand(q.shape[0])[:, None]))[:, None, None]
    return F.scaled_dot_product_attention(
        q.float(), k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=mask
    )


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("splits,block_n", [(1, 64), (3, 16), (64, 16)])
def test_decode_attention_matches_sdpa(splits, block_n, per_row):
    """Rows with their own left padding, one position for all or one per row; the row's keys in one span, three,
    or 64 spans of at least 4 key blocks (most of them empty)."""
    q, k, v = _inputs(300, seed=0)
    pad = torch.tensor([0, 3, 64, 130, 250])
    cur = torch.tensor([280, 40, 299, 131, 250]) if per_row else torch.tensor([260])
    out = triton_decode.decode_attention(q, k, v, pad, cur, splits=splits, block_n=block_n)
    assert out.dtype == DT and out.shape == q.shape
    torch.testing.assert_close(out.float(), _sdpa(q, k, v, pad, cur), atol=2e-3, rtol=2e-3)


def test_paged_cache_equals_the_contiguous_cache_bitwise():
    """Each row read through a shuffled page table (16-position pages, padding not page-aligned)."""
    page, per_row = 16, 12
    q, k, v = _inputs(page * per_row, seed=1)
    g = torch.Generator().manual_seed(1)
    table = (torch.randperm(ROWS * per_row, generator=g) + 1).view(ROWS, per_row).to(torch.int32)
    flat_k, flat_v = (torch.zeros((ROWS * per_row + 1) * page, GROUPS, DIM, dtype=DT) for _ in "kv")
    at = (table.long()[:, :, None] * page + torch.arange(page)).view(ROWS, -1)
    flat_k[at], flat_v[at] = k, v
    pad, cur = torch.tensor([0, 3, 17, 100, 180]), torch.tensor([150, 20, 191, 101, 180])
    a = triton_decode.decode_attention(q, k, v, pad, cur, splits=3, block_n=16)
    b = triton_decode.decode_attention(
        q, flat_k, flat_v, pad, cur, table=table, page=page, splits=3, block_n=16
    )
    assert torch.equal(a, b)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_a_shared_prompt_is_read_from_its_lead_row(splits, paged):
    """`sourced`: rows 0-2 share a prompt at positions [5, 42) led by row 1, rows 3-4 one at [0, 20) led by
    row 4, which has finished (it reads its one key, yet is still row 3's source): the other rows' copies of
    the prompt are poisoned (inf), yet every row's output matches SDPA over clean K/V (float32, 2e-3), with
    the row's keys in one span or three (spans that start inside the prompt, end inside it, or straddle its
    end). Paged: through a shuffled page table, the lead row's page-table row."""
    page, cache_len = 16, 96
    q, k, v = _inputs(cache_len, seed=6)
    start, end = torch.tensor([5, 5, 5, 0, 0]), torch.tensor([42, 42, 42, 20, 20])
    pad, cur = start.clone(), torch.tensor([60, 41, 90, 19, 70])
    pad[4] = cur[4]  # finished
    lead = torch.tensor([1, 1, 1, 4, 4])
    for r in range(ROWS):  # the group's prompt positions hold the lead row's K/V
        k[r, : end[r]], v[r, : end[r]] = k[lead[r], : end[r]], v[lead[r], : end[r]]
    reference = _sdpa(q, k, v, pad, cur)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for r in (0, 2, 3):
        poisoned_k[r, start[r] : end[r]] = poisoned_v[r, start[r] : end[r]] = float("inf")
    args, kw = (q, poisoned_k, poisoned_v, pad, cur), {"splits": splits, "block_n": 16}
    if paged:
        per_row = cache_len // page
        g = torch.Generator().manual_seed(6)
        table = (torch.randperm(ROWS * per_row, generator=g) + 1).view(ROWS, per_row).to(torch.int32)
        flat_k, flat_v = (torch.zeros((ROWS * per_row + 1) * page, GROUPS, DIM, dtype=DT) for _ in "kv")
        at = (table.long()[:, :, None] * page + torch.arange(page)).view(ROWS, -1)
        flat_k[at], flat_v[at] = poisoned_k, poisoned_v
        args, kw = (q, flat_k, flat_v, pad, cur), {**kw, "table": table, "page": page}
    out = triton_decode.decode_attention(*args, sourced=(lead, end), **kw)
    torch.testing.assert_close(out.float(), reference, atol=2e-3, rtol=2e-3)
    assert not triton_decode.decode_attention(*args, **kw).isfinite().all()  # (the poison is read without)


@pytest.mark.parametrize("splits", [1, 5, 40])
def test_triton_merge_equals_merge_splits(splits):
    """The same partial states merged by the Triton kernel and by `merge_splits` (eager on the CPU); one split:
    the output the partials' kernel writes itself against the eager division."""
    q, k, v = _inputs(400, seed=2)
    pad, cur = torch.tensor([0, 5, 300, 100, 399]), torch.tensor([399, 6, 350, 300, 399])
    args = (q, k, v, pad, cur)
    fused = triton_decode.decode_attention(*args, splits=splits, block_n=16, triton_merge=True)
    plain = triton_decode.decode_attention(*args, splits=splits, block_n=16, triton_merge=False)
    torch.testing.assert_close(fused.float(), plain.float(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("rows,split", [(1, 1), (5, 2), (16, 3), (33, 4)])
def test_narrow_mlp_matches_the_linear_chain(rows, split):
    """fc1 + SwiGLU, then fc2 in `split` float32 partials, against F.linear, SwiGLU and F.linear in float32 on the
    same float16 inputs (sizes no tile divides: masked rows and K tails); the partials added by
    `add_partials_rms_norm` as the engine adds them; every program's range within its tile, a whole number of programs per SM."""
    g = torch.Generator().manual_seed(rows)
    hidden, ffn = 96, 200
    h = torch.randn(rows, hidden, generator=g).to(DT)
    fc1 = (torch.randn(2 * ffn, hidden, generator=g) / hidden**0.5).to(DT)
    fc2 = (torch.randn(hidden, ffn, generator=g) / ffn**0.5).to(DT)
    gate, up = F.linear(h.float(), fc1.float()).to(DT).float().chunk(2, dim=-1)  # rounded as cuBLAS's outputs
    tiles = triton_mlp.MlpTiles(block_f=16, block_k1=32, block_n=16, block_k2=32, split=split)
    mid = triton_mlp.fc1_swiglu(h, fc1, tiles)
    torch.testing.assert_close(mid.float(), F.silu(gate) * up, atol=2e-3, rtol=2e-3)
    out = triton_mlp.fc2(mid, fc2, tiles)
    assert out.shape == ((rows, hidden) if split == 1 else (split, rows, hidden))
    assert out.dtype == (DT if split == 1 else torch.float32)
    ref = F.linear(mid.float(), fc2.float())
    torch.testing.assert_close(out.float() if split == 1 else out.sum(0), ref, atol=2e-3, rtol=2e-3)
    zero, ones = torch.zeros(rows, hidden, dtype=DT), torch.ones(hidden, dtype=DT)
    summed = (zero + out.to(DT)) if split == 1 else add_partials_rms_norm(zero, out, ones, 1e-6)[0]
    torch.testing.assert_close(summed.float(), ref, atol=2e-3, rtol=2e-3)
    chain = F.linear(swiglu(F.linear(h.float(), fc1.float())), fc2.float())
    torch.testing.assert_close(summed.float(), chain, atol=5e-3, rtol=5e-3)
    for n, block, per, sms in ((8960, 32, 1, 132), (1536, 32, 4, 132), (896, 32, 8, 132), (200, 16, 3, 4)):
        programs = triton_mlp.programs_for(n, block, per, sms)
        assert -(-n // programs) <= block and (programs * per) % sms == 0, (n, block, per, sms, programs)


@pytest.mark.parametrize("paged", [False, True])
def test_rope_write_kv_matches_rope_and_indexed_writes(paged):
    """Rotated query heads and key against `apply_rope`, the key and value at each row's own position, nothing else
    in the cache touched."""
    g = torch.Generator().manual_seed(5)
    positions = 40
    qkv = torch.randn(ROWS, GROUPS, PER_GROUP + 2, DIM, generator=g).to(DT)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    emb = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq).repeat(1, 2)
    cur = torch.tensor([3, 39, 20, 0, 31])
    pos = cur - torch.tensor([0, 10, 7, 0, 1])  # left padding
    cos, sin = emb.cos().to(DT)[pos], signed_sin(emb.sin().to(DT))[pos]
    shape = (ROWS * positions, GROUPS, DIM) if paged else (ROWS, positions, GROUPS, DIM)
    cache_k, cache_v = (torch.randn(shape, generator=g).to(DT) for _ in "kv")
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    at = torch.randperm(ROWS * positions, generator=g)[:ROWS] if paged else cur
    q = triton_rope_kv.rope_write_kv(qkv, cos, sin, cache_k, cache_v, at, paged)
    qk = apply_rope(qkv[:, :, : PER_GROUP + 1], cos[:, None, None], sin[:, None, None])
    index = (at,) if paged else (torch.arange(ROWS), cur)
    ref_k[index], ref_v[index] = qk[:, :, PER_GROUP], qkv[:, :, PER_GROUP + 1]
    torch.testing.assert_close(q.float(), qk[:, :, :PER_GROUP].float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(cache_k.float(), ref_k.float(), atol=2e-3, rtol=2e-3)
    assert torch.equal(cache_v, ref_v)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 3])  # 3: spans of >= 4 key blocks over <= 96 keys, some splits empty
@pytest.mark.parametrize("sourced", [False, True])
def test_rope_inside_the_attention_equals_the_two_kernels(splits, paged, sourced):
    """`decode_attention(rope=...)` on the raw projection against `rope_write_kv` then `decode_attention`: the
    caches equal bitwise (the same rotated key and value at each row's position, nothing else touched), the
    output within fp16 rounding of it (the new key's score and weight from registers, not `tl.dot`: summed in
    another order), one position for all rows or one per row, a row whose only key is the new one (pad =
    cur), rows of a shared prompt read from their lead row."""
    page, cache_len = 16, 96
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(ROWS, GROUPS, PER_GROUP + 2, DIM, generator=g).to(DT)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    emb = torch.outer(torch.arange(cache_len, dtype=torch.float32), inv_freq).repeat(1, 2)
    _, k, v = _inputs(cache_len, seed=9)
    end = torch.tensor([20, 20, 20, 30, 30])
    lead = torch.tensor([0, 0, 0, 4, 4])
    for r in range(ROWS):  # the group's prompt positions hold the lead row's K/V
        k[r, : end[r]], v[r, : end[r]] = k[lead[r], : end[r]], v[lead[r], : end[r]]
    pad, cur = torch.tensor([0, 2, 5, 0, 30]), torch.tensor([60, 21, 95, 33, 30])
    for cur_given in (cur, torch.tensor([40])):
        cur_rows = cur_given.expand(ROWS)
        pos = cur_rows - pad
        cos, sin = emb.cos().to(DT)[pos], signed_sin(emb.sin().to(DT))[pos]
        if paged:
            per_row = cache_len // page
            table = (torch.randperm(ROWS * per_row, generator=g) + 1).view(ROWS, per_row).to(torch.int32)
            flat = (torch.zeros((ROWS * per_row + 1) * page, GROUPS, DIM, dtype=DT) for _ in "kv")
            cache_k, cache_v = flat
            at_all = (table.long()[:, :, None] * page + torch.arange(page)).view(ROWS, -1)
            cache_k[at_all], cache_v[at_all] = k, v
            at = table.long().gather(1, (cur_rows // page)[:, None])[:, 0] * page + cur_rows % page
            kw = {"table": table, "page": page}
        else:
            cache_k, cache_v, at, kw = k.clone(), v.clone(), cur_rows, {}
        kw = {**kw, "splits": splits, "block_n": 16, "sourced": (lead, end) if sourced else None}
        two_k, two_v = cache_k.clone(), cache_v.clone()
        q = triton_rope_kv.rope_write_kv(qkv, cos, sin, two_k, two_v, at, paged)
        expected = triton_decode.decode_attention(q, two_k, two_v, pad, cur_given, **kw)
        out = triton_decode.decode_attention(qkv, cache_k, cache_v, pad, cur_given, rope=(cos, sin), **kw)
        assert torch.equal(cache_k, two_k) and torch.equal(cache_v, two_v)
        assert out.shape == expected.shape == (ROWS, GROUPS, PER_GROUP, DIM)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-3, rtol=2e-3)
        # and against SDPA in float32 over the written cache (contiguous: the cache itself)
        if not paged:
            ref = _sdpa(q, two_k, two_v, pad, cur_given)
            torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def _teacher_forced(shape, weights, dtype, kernels: DecodeKernels, ids, pad, steps: int):
    """Prefill left-padded `ids`, then `steps` decode steps fed tokens (t * 7 + row) % vocab: every step's
    logits, float32, and which attention kernel the model picked."""
    params = {k: v.to(dtype) for k, v in weights.params.items()}
    cpu = torch.device("cpu")
    model = RolloutModel(
        shape, RolloutWeights(params, 1, 0, None, None, 0, 1), rope_tables(shape, cpu, dtype), kernels
    )
    rows, plen = ids.shape
    pool = KVCachePool(shape.num_layers, model.groups, model.head_dim, dtype, cpu, budget_bytes=1 << 24)
    k, v = pool.views(rows, plen + steps)
    out = [model.prefill(ids, pad, k, v, torch.arange(rows))]
    for t in range(steps):
        tokens = (t * 7 + torch.arange(rows)) % shape.vocab_size
        out.append(model.decode(tokens, pad, torch.tensor([plen + t]), k, v, plen + t + 1))
    return torch.stack(out).float(), model


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_decode_forward_with_the_triton_kernels(family, tmp_path):
    """Teacher-forced decode logits of a tiny checkpoint (QKV bias and tied embeddings, or Llama-3 RoPE
    scaling) with the Triton attention, fused RoPE/K-V write, Triton merge and Triton MLP (the GPU's default
    kernels), with the Triton attention alone, with other attention tiles, and with the MLP as F.linear and
    SwiGLU: within 1.5x the float16 SDPA path's
    distance to a float32 forward, and the same argmax nearly everywhere."""
    path = hf_tiny.save_tiny(family, str(tmp_path / family), seed=3, max_position_embeddings=512)
    shape, weights = rollout_weights_from_hf(path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape.vocab_size, (6, 11), generator=g)
    pad = torch.tensor([0, 4, 10, 1, 0, 7])
    plain = DecodeKernels(attention="sdpa", compiled=False)
    ref, _ = _teacher_forced(shape, weights, torch.float32, plain, ids, pad, 12)
    slow, _ = _teacher_forced(shape, weights, DT, plain, ids, pad, 12)
    fused, model = _teacher_forced(shape, weights, DT, DecodeKernels("triton", compiled=False), ids, pad, 12)
    assert model.attention == "triton" and model.fused_rope_kv
    assert model.triton_mlp  # the decode steps' MLP (6 rows) ran as engine/rollout/triton_mlp.py's kernels
    unfused, _ = _teacher_forced(shape, weights, DT, DecodeKernels("triton", False, False), ids, pad, 12)
    cublas = DecodeKernels("triton", compiled=False, mlp=False)
    linear_mlp, model = _teacher_forced(shape, weights, DT, cublas, ids, pad, 12)
    assert not model.triton_mlp and not torch.equal(linear_mlp[1:], fused[1:])  # (decode steps differ)
    tiles = DecodeKernels("triton", compiled=False, attention_tiles=(16, 1, 1, 64))
    tiled, model = _teacher_forced(shape, weights, DT, tiles, ids, pad, 12)
    assert model.attention_knobs == {"block_n": 16, "num_warps": 1, "num_stages": 1, "max_registers": 64}
    assert not torch.equal(tiled, fused)  # 16-key blocks reached the kernel: other roundings than 64's
    err_slow = (slow - ref).abs()
    for fast in (fused, unfused, tiled, linear_mlp):
        err = (fast - ref).abs()
        assert err.max() <= 1.5 * err_slow.max() + 1e-3, (float(err.max()), float(err_slow.max()))
        assert err.mean() <= 1.5 * err_slow.mean() + 1e-4, (float(err.mean()), float(err_slow.mean()))
        assert (fast.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_paged_generation_equals_the_contiguous_layout(tmp_path):
    """A long-tailed generate call through the native engine with the Triton kernels (rows finish at their own
    limits and new rows take their slots): the K/V in pages gives the contiguous layout's tokens and log-probs
    bit for bit (the same kernels read both through their own addressing)."""
    from test_rollout_native import random_prompts

    from engine.rollout.base import SamplingParams
    from engine.rollout.native import NativeRollout

    path = hf_tiny.save_tiny("qwen2", str(tmp_path / "qwen2"), seed=4, max_position_embeddings=512)
    shape, weights = rollout_weights_from_hf(path)
    params = RolloutWeights({k: v.to(DT) for k, v in weights.params.items()}, 1, 0, None, None, 0, 1)
    prompts = random_prompts(shape.vocab_size, lens=tuple(range(3, 15)), seed=4)
    limits = (20, 3, 2, 5, 2, 16, 3, 2, 6, 2, 3, 2)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=20, max_new_tokens_per_prompt=limits)
    outs = []
    for paged in (False, True):
        e = NativeRollout(shape, torch.device("cpu"), max_num_seqs=6, paged_kv=paged)
        e.set_weights(params)
        outs.append(e.generate(prompts, sampling))
        assert e.model.attention == "triton" and bool(e.last_stats.get("paged")) == paged, e.last_stats
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    assert torch.equal(outs[0].log_probs, outs[1].log_probs)


def _check_prompt_readers(engine, seen):
    """Wrap `engine.model.decode`: at every step with a shared prompt, each live slot's prompt is read from a
    slot of its own group (itself or another), whose cache holds the same K/V at the same prompt positions;
    `seen` collects (group, source slot) pairs."""
    decode = engine.model.decode

    def checked(tokens, pad, cur, cache_k, cache_v, num_keys, table=None, page=0, **kw):
        st, prefix = engine._rows, kw["prefix"]
        if prefix is not None:
            for r in st.alive[: len(tokens)].nonzero().flatten().tolist():
                p = int(prefix[0][r])
                assert st.group[p] == st.group[r] and st.prefix_end[p] == st.prefix_end[r] <= cur[r], (r, p)
                at = torch.arange(int(pad[r]), int(st.prefix_end[r]))
                for layer in cache_k + cache_v:
                    if table is None:
                        own, other = layer[r, at], layer[p, at]
                    else:
                        own, other = (layer[table[x, at // page].long() * page + at % page] for x in (r, p))
                    assert torch.equal(own, other), (r, p)
                seen.add((int(st.group[r]), p))
        return decode(tokens, pad, cur, cache_k, cache_v, num_keys, table, page, **kw)

    engine.model.decode = checked


@pytest.mark.parametrize("paged", [False, True])
def test_samples_of_a_prompt_read_it_from_one_copy(paged, tmp_path):
    """Three samples per prompt, drawn at temperature 1, ending at stop tokens (so a group's first sample often
    ends before the others) and per-prompt limits, in batches of 9 slots with rows admitted as others finish:
    with each slot reading its prompt from its group's first live slot (at every width here) the sampled
    tokens' log-probs are within 1.5x the distance of every row reading its own copy (`shared_prefix=False`) to
    transformers' float32 teacher-forced ones (float16: the two may draw other tokens where a draw is near a
    boundary); at every step each live slot's prompt is read from a slot of its group that holds the same K/V,
    and some groups changed that slot, in later admissions too."""
    from test_rollout_native import largest_log_prob_error, random_prompts
    from transformers import AutoModelForCausalLM

    from engine.rollout.base import SamplingParams
    from engine.rollout.native import NativeRollout

    path = hf_tiny.save_tiny("qwen2", str(tmp_path / "qwen2"), seed=7, max_position_embeddings=512)
    shape, weights = rollout_weights_from_hf(path)
    params = RolloutWeights({k: v.to(DT) for k, v in weights.params.items()}, 1, 0, None, None, 0, 1)
    prompts = random_prompts(shape.vocab_size, lens=(5, 9, 3, 7), seed=7)
    sampling = SamplingParams(
        n=3,
        temperature=1.0,
        max_new_tokens=10,
        max_new_tokens_per_prompt=(10, 4, 10, 7),
        stop_token_ids=tuple(range(0, shape.vocab_size, 12)),
        seed=7,
    )
    outs, seen = [], set()
    for shared in (True, False):
        kernels = DecodeKernels("triton", compiled=False, shared_prefix=shared, shared_prefix_min_rows=1)
        e = NativeRollout(shape, torch.device("cpu"), max_num_seqs=9, paged_kv=paged, kernels=kernels)
        e.set_weights(params)
        assert e.model.shared_prefix == shared
        if shared:
            _check_prompt_readers(e, seen)
        outs.append(e.generate(prompts, sampling))
        assert bool(e.last_stats["paged"]) == paged and e.last_stats["chunks"] > 1, e.last_stats
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    errors = [largest_log_prob_error(hf, prompts, sampling.n, out) for out in outs]
    assert errors[0] <= 1.5 * errors[1] + 1e-3, errors
    assert "stop" in outs[0].finish_reasons and "length" in outs[0].finish_reasons
    readers = {}
    for group, p in seen:
        readers.setdefault(group, set()).add(p)
    assert any(len(s) > 1 for g, s in readers.items() if g >> 32 > 1), readers  # (in a later chunk too)


def test_triton_draw_follows_the_distribution_with_full_vocab_log_probs():
    """The two-level inverse-CDF draw (engine/rollout/triton_sample.py) over 384 rows of one five-token
    distribution at temperature 0.5 across four tiles (a tile's first and last columns, the vocabulary's last,
    a whole tile of -inf logits and -inf columns beside the tokens; the rest far below): frequencies against
    softmax(logits / T) (chi-square, 4 degrees of freedom, below the 0.1% point), only the five tokens drawn,
    log-probs equal to log_softmax(logits / T) over the whole vocabulary, the same seed the same tokens (on the
    first rows alone too), another seed others; `sample_tokens(fused=True)` takes this path."""
    from engine.rollout import triton_sample
    from engine.rollout.base import SamplingParams
    from engine.rollout.sampler import sample_tokens

    tile = triton_sample.TILE
    rows, vocab, t = 384, 3 * tile + 100, 0.5
    support = torch.tensor([3, tile - 1, tile, 2 * tile - 1, vocab - 1])
    logits = torch.full((rows, vocab), -12.0)
    logits[:, tile : 3 * tile] = float("-inf")  # tile 1 all -inf but its two tokens, tile 2 all -inf
    logits[:, support] = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]).log()
    logits = logits.to(DT)
    full = (logits.float() / t).log_softmax(-1)
    tokens, logp = triton_sample.sample(logits, 1 / t, torch.Generator().manual_seed(0))
    assert tokens.dtype == torch.int64 and logp.dtype == torch.float32
    assert set(tokens.tolist()) <= set(support.tolist())
    torch.testing.assert_close(logp, full.gather(1, tokens[:, None]).squeeze(1), atol=1e-5, rtol=0)
    expected = full[0, support].exp() * rows
    observed = torch.bincount(tokens, minlength=vocab)[support].float()
    assert float(((observed - expected) ** 2 / expected).sum()) < 18.47, (observed, expected)
    first = logits[:48]  # a row's numbers depend on the seed and its index only
    again = sample_tokens(first, SamplingParams(temperature=t), torch.Generator().manual_seed(0), fused=True)
    other, _ = triton_sample.sample(first, 1 / t, torch.Generator().manual_seed(1))
    assert torch.equal(again[0], tokens[:48]) and not torch.equal(other, tokens[:48])


def test_triton_draw_merges_a_row_cut_into_chunks():
    """Two rows over five tiles (each row cut into chunks whose tiles' statistics `_draw` merges): the uniform
    mass over six tokens at tile and chunk edges comes out in every one of them over 48 draws, and the
    log-prob is log(1/6) up to the rest of the vocabulary's mass; rows of a strided view (the head's padded
    output) read the same."""
    from engine.rollout import triton_sample

    tile = triton_sample.TILE
    vocab = 4 * tile + 500
    support = [0, tile - 1, tile, 3 * tile - 1, 3 * tile, vocab - 1]
    logits = torch.full((2, vocab + 8), -30.0)
    logits[:, support] = 0.0
    view = logits.to(DT)[:, :vocab]
    assert view.stride(0) == vocab + 8
    drawn = []
    for seed in range(24):
        tokens, logp = triton_sample.sample(view, 1.0, torch.Generator().manual_seed(seed))
        drawn += tokens.tolist()
        torch.testing.assert_close(logp, view.float().log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))
    assert set(drawn) == set(support)
