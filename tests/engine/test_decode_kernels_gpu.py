"""The native rollout's decode-attention and RoPE/K-V kernels alone on CUDA (marked `gpu`, skipped on CPU), in
bfloat16 at Qwen2.5 head shapes: the Triton decode attention against float32 SDPA (split key ranges, rows at
their own positions; rows reading a shared prompt from their group's first row, other copies poisoned), the
paged cache against the contiguous one bit for bit, the Triton split merge against the compiled one, and the
fused RoPE/K-V write against the compiled RoPE and indexed writes, the narrow MLP's two kernels against
cuBLAS and the compiled SwiGLU (at Qwen2.5-1.5B's and 7B's MLP shapes). The engine around them:
tests/engine/test_rollout_gpu.py; the same kernels under Triton's interpreter: tests/engine/interpreted_triton.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("splits,block_n", [(None, 64), (3, 32), (5, 64), (64, 16)])
def test_triton_decode_attention_matches_sdpa(splits, block_n, per_row):
    """Qwen2.5-7B's head shape (7 query heads per KV group, dim 128), rows with different left padding,
    each row's keys split or not (empty splits included: 64 splits of at least 4 key blocks leave most of a
    row's splits empty), one position for every row or one per row (rows admitted at different times): vs
    SDPA in float32 on the same bf16 values."""
    from engine.rollout import triton_decode

    g = torch.Generator(device=DEV).manual_seed(0)
    rows, groups, per_group, dim, cache_len, cur = 5, 2, 7, 128, 700, 650
    q = torch.randn(rows, groups, per_group, dim, device=DEV, generator=g).bfloat16()
    k, v = (torch.randn(rows, cache_len, groups, dim, device=DEV, generator=g).bfloat16() for _ in range(2))
    pad = torch.tensor([0, 3, 64, 130, 640], device=DEV)
    cur_t = torch.tensor([cur], device=DEV)
    if per_row:
        cur_t = torch.tensor([cur, 40, 699, 131, 640], device=DEV)
    out = triton_decode.decode_attention(q, k, v, pad, cur_t, splits=splits, block_n=block_n)
    ar = torch.arange(cache_len, device=DEV)
    mask = ((ar >= pad[:, None]) & (ar <= cur_t.expand(rows)[:, None]))[:, None, None]
    ref = F.scaled_dot_product_attention(
        q.float(), k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=mask
    )
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)  # bf16 output rounding + P in bf16


@pytest.mark.parametrize("group_size,per_group", [(8, 6), (16, 7)])
def test_triton_sourced_prompt_matches_sdpa(group_size, per_group):
    """Each row reading its prompt from its group's first row (`sourced`) at Qwen2.5-1.5B's and -7B's head
    shapes, bf16: 64 rows in groups of 8 or 16 sharing a 300-position prompt after their own left padding, rows
    at their own positions, a finished row that still is its group's source; the rows' other copies of the
    prompt poisoned: vs SDPA in float32 on clean K/V."""
    from engine.rollout import triton_decode

    g = torch.Generator(device=DEV).manual_seed(1)
    rows, groups, dim, cache_len = 64, 2, 128, 900
    q = torch.randn(rows, groups, per_group, dim, device=DEV, generator=g).bfloat16()
    k, v = (torch.randn(rows, cache_len, groups, dim, device=DEV, generator=g).bfloat16() for _ in range(2))
    lead = torch.arange(rows, device=DEV) // group_size * group_size
    start = torch.randint(0, 40, (rows,), device=DEV, generator=g)[lead]
    end = start + 300
    cur = end + torch.randint(0, 560, (rows,), device=DEV, generator=g)
    pad = start.clone()
    pad[0] = cur[0]  # row 0 finished: it reads its one key and still leads its group
    prompt = (torch.arange(cache_len, device=DEV)[None, :] < end[:, None])[:, :, None, None]
    k, v = (torch.where(prompt, t[lead], t) for t in (k, v))
    ar = torch.arange(cache_len, device=DEV)
    mask = ((ar >= pad[:, None]) & (ar <= cur[:, None]))[:, None, None]
    ref = F.scaled_dot_product_attention(
        q.float(), k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=mask
    )
    poisoned = ~(torch.arange(rows, device=DEV) == lead)[:, None, None, None] & prompt
    k, v = (t.masked_fill(poisoned, float("inf")) for t in (k, v))
    out = triton_decode.decode_attention(q, k, v, pad, cur, sourced=(lead, end))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("splits", [None, 3])
def test_triton_paged_decode_equals_the_contiguous_cache_bitwise(splits):
    """The Triton kernel reading each row through a shuffled page table (64-position pages, rows at their own
    positions, left padding not page-aligned) gives the contiguous cache's output bit for bit."""
    from engine.rollout import triton_decode

    g = torch.Generator(device=DEV).manual_seed(0)
    rows, groups, per_group, dim, page, per_row = 5, 2, 7, 128, 64, 11
    q = torch.randn(rows, groups, per_group, dim, device=DEV, generator=g).bfloat16()
    k, v = (
        torch.randn(rows, per_row * page, groups, dim, device=DEV, generator=g).bfloat16() for _ in range(2)
    )
    pages = torch.randperm(rows * per_row, device=DEV, generator=g) + 1
    table = pages.view(rows, per_row).to(torch.int32)
    flat_k, flat_v = (
        torch.zeros((rows * per_row + 1) * page, groups, dim, device=DEV).bfloat16() for _ in "kv"
    )
    at = (table.long()[:, :, None] * page + torch.arange(page, device=DEV)).view(rows, -1)
    flat_k[at], flat_v[at] = k, v
    pad = torch.tensor([0, 3, 64, 130, 640], device=DEV)
    cur = torch.tensor([650, 40, 703, 131, 640], device=DEV)
    a = triton_decode.decode_attention(q, k, v, pad, cur, splits=splits)
    b = triton_decode.decode_attention(q, flat_k, flat_v, pad, cur, table=table, page=page, splits=splits)
    assert torch.equal(a, b)


@pytest.mark.parametrize("splits", [1, 3, 5, 40])
def test_triton_merge_equals_the_compiled_merge(splits):
    """The split merge as one Triton kernel against the compiled `merge_splits` (and, with one split, the
    eager division): the same states, bf16 outputs within one rounding step, nearly all equal."""
    from engine.rollout import triton_decode

    g = torch.Generator(device=DEV).manual_seed(3)
    rows, groups, per_group, dim = 6, 2, 6, 128
    q = torch.randn(rows, groups, per_group, dim, device=DEV, generator=g).bfloat16()
    k, v = (torch.randn(rows, 900, groups, dim, device=DEV, generator=g).bfloat16() for _ in range(2))
    pad = torch.tensor([0, 5, 300, 640, 0, 899], device=DEV)
    cur = torch.tensor([899, 6, 800, 700, 64, 899], device=DEV)
    args = (q, k, v, pad, cur)
    fused = triton_decode.decode_attention(*args, splits=splits, triton_merge=True)
    compiled = triton_decode.decode_attention(*args, splits=splits, triton_merge=False)
    assert fused.shape == q.shape and fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), compiled.float(), atol=1e-3, rtol=8e-3)
    assert (fused == compiled).float().mean() >= 0.99


@pytest.mark.parametrize("paged", [False, True])
def test_fused_rope_kv_write_equals_the_unfused_chain(paged):
    """RoPE and the K/V writes in one Triton kernel against the compiled RoPE and indexed writes: rotated
    query heads and key within one bf16 rounding step (nearly all equal), the value written bit for bit, at
    each row's own position (contiguous rows, or a flat paged buffer), nothing else in the cache touched."""
    from engine.models.compiled import ROLLOUT, cuda_kernel
    from engine.rollout.rope import apply_rope, signed_sin
    from engine.rollout.triton_rope_kv import rope_write_kv

    g = torch.Generator(device=DEV).manual_seed(5)
    rows, groups, per_group, dim, positions = 5, 2, 7, 128, 96
    proj = torch.randn(rows, groups * (per_group + 2) * dim, device=DEV, generator=g).bfloat16()
    qkv = proj.view(rows, groups, per_group + 2, dim)
    cos_t, sin_t = (t.to(DEV) for t in rope_tables_for(dim, positions))
    cur = torch.tensor([3, 95, 40, 0, 64], device=DEV)
    pos = cur - torch.tensor([0, 10, 7, 0, 1], device=DEV)  # left padding
    cos, sin = cos_t[pos], signed_sin(sin_t)[pos]
    shape = (rows * positions, groups, dim) if paged else (rows, positions, groups, dim)
    cache_k, cache_v = (torch.randn(shape, device=DEV, generator=g).bfloat16() for _ in "kv")
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    at = torch.randperm(rows * positions, device=DEV, generator=g)[:rows] if paged else cur
    q = rope_write_kv(qkv, cos, sin, cache_k, cache_v, at, paged)
    rope = cuda_kernel(apply_rope, DEV, ROLLOUT, dynamic=None)
    qk = rope(qkv[:, :, : per_group + 1], cos[:, None, None], sin[:, None, None])
    index = (at,) if paged else (torch.arange(rows, device=DEV), cur)
    ref_k[index], ref_v[index] = qk[:, :, per_group], qkv[:, :, per_group + 1]
    torch.testing.assert_close(q.float(), qk[:, :, :per_group].float(), atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(cache_k.float(), ref_k.float(), atol=1e-2, rtol=8e-3)
    assert torch.equal(cache_v, ref_v)
    assert (q == qk[:, :, :per_group]).float().mean() >= 0.99 and (cache_k == ref_k).float().mean() >= 0.99


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("per_group,dim,splits", [(7, 64, None), (6, 128, None), (7, 128, 5)])
def test_rope_inside_the_attention_equals_the_two_kernels(per_group, dim, splits, paged):
    """`decode_attention(rope=...)` (RoPE and the K/V writes in the attention kernel, the new key read from
    registers) against `rope_write_kv` then `decode_attention`, bf16 at Qwen2.5-0.5B/1.5B/7B head shapes:
    the caches bit for bit, the outputs within one bf16 rounding step (nearly all equal)."""
    from engine.rollout import triton_decode
    from engine.rollout.rope import signed_sin
    from engine.rollout.triton_rope_kv import rope_write_kv

    g = torch.Generator(device=DEV).manual_seed(7)
    rows, groups, page, cache_len = 64, 2, 16, 512
    qkv = torch.randn(rows, groups, per_group + 2, dim, device=DEV, generator=g).bfloat16()
    cos_t, sin_t = (t.to(DEV) for t in rope_tables_for(dim, cache_len))
    pad = torch.randint(0, 40, (rows,), device=DEV, generator=g)
    cur = pad + torch.randint(0, 400, (rows,), device=DEV, generator=g)
    cos, sin = cos_t[cur - pad], signed_sin(sin_t)[cur - pad]
    if paged:
        per_row = cache_len // page
        table = (torch.randperm(rows * per_row, device=DEV, generator=g) + 1).view(rows, per_row).int()
        cache_k, cache_v = (
            torch.randn((rows * per_row + 1) * page, groups, dim, device=DEV, generator=g).bfloat16()
            for _ in "kv"
        )
        at = table.long().gather(1, (cur // page)[:, None])[:, 0] * page + cur % page
        kw = {"table": table, "page": page}
    else:
        shape = (rows, cache_len, groups, dim)
        cache_k, cache_v = (torch.randn(shape, device=DEV, generator=g).bfloat16() for _ in "kv")
        at, kw = cur, {}
    two_k, two_v = cache_k.clone(), cache_v.clone()
    q = rope_write_kv(qkv, cos, sin, two_k, two_v, at, paged)
    expected = triton_decode.decode_attention(q, two_k, two_v, pad, cur, splits=splits, **kw)
    out = triton_decode.decode_attention(
        qkv, cache_k, cache_v, pad, cur, splits=splits, rope=(cos, sin), **kw
    )
    assert torch.equal(cache_k, two_k) and torch.equal(cache_v, two_v)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=8e-3)
    assert (out == expected).float().mean() >= 0.9


@pytest.mark.parametrize("hidden,ffn", [(1536, 8960), (3584, 18944)])
def test_narrow_mlp_matches_cublas_and_is_deterministic(hidden, ffn):
    """engine/rollout/triton_mlp.py `decode_mlp` with its default tiles at widths 1-64, fc2's partials added by
    `add_partials_rms_norm` as the engine adds them: within 1.25x cuBLAS + the compiled SwiGLU's distance to a
    float32 chain (on the same bf16 inputs, gate/up/mid rounded where the engine rounds them), bit for bit the
    same on a second call and in a CUDA graph."""
    from engine.models.compiled import ROLLOUT, cuda_kernel
    from engine.rollout import triton_mlp
    from engine.rollout.model import add_partials_rms_norm, add_rms_norm, swiglu

    g = torch.Generator(device=DEV).manual_seed(4)
    fc1 = torch.randn(2 * ffn, hidden, device=DEV, generator=g).bfloat16() * 0.02
    fc2 = torch.randn(hidden, ffn, device=DEV, generator=g).bfloat16() * 0.02
    add_parts, act = cuda_kernel(add_partials_rms_norm, DEV, ROLLOUT), cuda_kernel(swiglu, DEV, ROLLOUT)
    add_norm = cuda_kernel(add_rms_norm, DEV, ROLLOUT)
    for rows in (1, 8, 24, 64):
        h = torch.randn(rows, 1, hidden, device=DEV, generator=g).bfloat16()
        zero = torch.zeros_like(h)
        gate, up = F.linear(h.float(), fc1.float()).bfloat16().float().chunk(2, dim=-1)
        ref = F.linear((F.silu(gate) * up).bfloat16().float(), fc2.float())
        cublas = F.linear(act(F.linear(h, fc1)), fc2).float()
        out = triton_mlp.decode_mlp(h, fc1, fc2)
        assert out.shape[-3:] == h.shape and out.dim() == (3 if out.dtype == torch.bfloat16 else 4)
        add = add_parts if out.dim() == 4 else add_norm
        fast = add(zero, out, torch.ones(hidden, device=DEV, dtype=torch.bfloat16), 1e-6)[0].float()
        err, err_cublas = (fast - ref).abs(), (cublas - ref).abs()
        assert err.max() <= 1.25 * err_cublas.max() + 1e-3, (rows, float(err.max()), float(err_cublas.max()))
        assert err.mean() <= 1.25 * err_cublas.mean() + 1e-5, (
            rows,
            float(err.mean()),
            float(err_cublas.mean()),
        )
        assert torch.equal(triton_mlp.decode_mlp(h, fc1, fc2), out)
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            triton_mlp.decode_mlp(h, fc1, fc2)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            captured = triton_mlp.decode_mlp(h, fc1, fc2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out)


@pytest.mark.parametrize("per_group,dim", [(7, 64), (6, 128)])
def test_register_capped_attention_equals_the_uncapped_bitwise(per_group, dim):
    """`decode_attention(occupancy=True)` (each launch capped at the registers that fit its programs in the
    fewest waves, from the variant's ladder of caps) at Qwen2.5-0.5B's and -1.5B's head shapes, paged, the
    prompt read from the group's first row, RoPE inside, 512 rows (1,024 programs unsplit: 2 waves or more
    uncapped on an H100/H200), one split and three: the output and the cache bit for bit as uncapped (a cap
    moves registers, not arithmetic); the ladders within the spill allowance, and the caps taken launched."""
    from engine.rollout import triton_decode
    from engine.rollout.occupancy import launched_kernels
    from engine.rollout.rope import signed_sin

    g = torch.Generator(device=DEV).manual_seed(8)
    rows, groups, page, cache_len = 512, 2, 64, 1024
    qkv = torch.randn(rows, groups, per_group + 2, dim, device=DEV, generator=g).bfloat16()
    cos_t, sin_t = (t.to(DEV) for t in rope_tables_for(dim, cache_len))
    lead = torch.arange(rows, device=DEV) // 8 * 8
    pad = torch.randint(0, 40, (rows,), device=DEV, generator=g)[lead]
    end = pad + 200
    cur = end + torch.randint(0, 700, (rows,), device=DEV, generator=g)
    cos, sin = cos_t[cur - pad], signed_sin(sin_t)[cur - pad]
    per_row = cache_len // page
    table = (torch.randperm(rows * per_row, device=DEV, generator=g) + 1).view(rows, per_row).int()
    cache = [
        torch.randn((rows * per_row + 1) * page, groups, dim, device=DEV, generator=g).bfloat16()
        for _ in "kv"
    ]
    for splits in (1, 3):
        outs = []
        for capped in (False, True):
            k, v = (c.clone() for c in cache)
            kw = dict(table=table, page=page, splits=splits, sourced=(lead, end), rope=(cos, sin))
            outs.append((triton_decode.decode_attention(qkv, k, v, pad, cur, occupancy=capped, **kw), k, v))
        assert all(torch.equal(a, b) for a, b in zip(*outs)), splits
    variants = [v for v in triton_decode.occupancy_caps() if v["head_dim"] == dim]
    assert {v["direct"] for v in variants} == {True, False}, variants
    taken = set()
    for v in variants:
        ladder = v["ladder"]
        assert ladder[0]["cap"] is None and all(r["spill_bytes"] <= 32 for r in ladder[1:]), v
        assert [r["programs_per_sm"] for r in ladder] == list(
            range(ladder[0]["programs_per_sm"], len(ladder) + ladder[0]["programs_per_sm"])
        ), v
        assert set(v["caps_by_programs"].values()) <= {r["cap"] for r in ladder}, v
        taken |= set(v["caps_by_programs"].values()) - {None}
    assert taken, f"no launch took a cap, nothing capped was compared: {variants}"
    launched = [k for k in launched_kernels() if k["kernel"].endswith("triton_decode._decode_partials")]
    assert taken <= {k["maxnreg"] for k in launched}, (taken, launched)  # the caps reached the launches


def rope_tables_for(dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 cos/sin tables as engine/rollout/rope.py `rope_tables` builds them (theta 1e6)."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    emb = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq).repeat(1, 2)
    return emb.cos().bfloat16(), emb.sin().bfloat16()
