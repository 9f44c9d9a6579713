"""Decode attention as a Triton kernel: one query token per row against that row's written KV-cache positions,
grouped-query attention with every query head of a KV group in one tile (flash-decoding).

Why not a library kernel: FlashAttention-2 (inside torch) tiles queries by 64-128 rows; a decode step has one
query per head, so even with the heads of a group folded into the query axis (7 rows for Qwen2.5) most of the
tile is padding, and at RL batch sizes the padded tile's math, not the memory traffic, bounds it. Here a tile
is 16 query rows (the smallest `tl.dot` takes) and the kernel streams K/V once per (row, group). The measured
bandwidths and times of both are in scripts/bench/README.md ("Rollout"; `scripts/bench/decode_attention.py`).

Layout: q (rows, groups, heads per group, dim) (any strides, unit stride over dim); the cache of a layer
(rows, positions, groups, dim) as engine/rollout/kv_cache.py lays it out. Row r attends over positions
[pad[r], cur[r]]; `cur` is read on the device (a (rows,) or (1,) tensor), so the launch can be captured in a CUDA graph.
Each row's own positions are cut into `splits` equal spans, one program each (more programs when rows x groups
alone would not fill the GPU): the work follows the rows' current lengths, not the cache's capacity, which a
CUDA graph fixes at capture (cutting the capacity instead left a 3,600-key row in one program of a 16k cache).
Each program writes its partial softmax state (max, sum, weighted values) in float32, and `decode_attention`
merges them (`_merge_splits`, one more Triton kernel, all splits of a head as one tile; or `merge_splits` compiled).
With one split (rows x groups fill the GPU alone: wide batches) the program writes the normalised output itself.
With `rope` the kernel also does the work of engine/rollout/triton_rope_kv.py's kernel, one launch fewer per
layer and step: each program reads its row's raw query heads from the fused QKV projection and rotates them,
and the program whose span holds the step's new position rotates the key, writes it and the value into the
cache, and attends to that key from registers (the cache's keys stop before it: nothing is read that this
launch writes).

The samples of one prompt (GRPO's group) hold the same K/V at the prompt's positions, each in its own row; with
`sourced` every row's program reads the prompt's positions from its group's first row and the rest from its
own, so that the group's programs, which run side by side, read one copy, most of it from L2 (1.5B, 512 rows
x 512 keys: 54 us per layer against 66 us; engine/rollout/attention_kernels.py `DecodeKernels.shared_prefix`).
A cascade (one program per group streaming the prompt once for all its samples' query heads, then a merge)
was built and measured slower (scripts/bench/README.md, "Rollout"), and removed.

Only on CUDA with Triton installed, in half precision (`supported`); engine/rollout/model.py falls back to
FlashAttention-2 or SDPA otherwise. Parity with SDPA: tests/engine/test_rollout_gpu.py.
"""

from __future__ import annotations

import math

import torch

from engine.models.compiled import ROLLOUT, cuda_kernel
from engine.models.triton_support import dot_supported, sm_count, tl, triton
from engine.rollout.occupancy import VariantLadders

if triton is not None:

    @triton.jit
    def _attend(
        q, k_row, v_row, table_row, lo, hi, stride_kl, stride_vl, m_i, l_i, acc, scale,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    ):  # fmt: skip
        """The online softmax of query tile `q` (rows, dim) carried over positions [lo, hi) of one cache row
        (`k_row`, `v_row`: that row's and KV group's base; paged: the flat cache's, and `table_row` the row's
        page-table row): returns the updated running max, sum (base 2) and weighted values."""
        offs_d = tl.arange(0, HEAD_DIM)
        qk_scale = scale * 1.4426950408889634  # softmax in base 2
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            key_ok = offs_n < hi
            if PAGE > 0:  # position n of the row sits at page table[row, n // PAGE], offset n % PAGE
                page = tl.load(table_row + offs_n // PAGE, mask=key_ok, other=0)
                at = page.to(tl.int64) * PAGE + offs_n % PAGE
            else:
                at = offs_n
            k = tl.load(k_row + at[:, None] * stride_kl + offs_d[None, :], mask=key_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_row + at[:, None] * stride_vl + offs_d[None, :], mask=key_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _attend_new_key(q, k, v, holds, m_i, l_i, acc, scale):
        """The online softmax of `_attend` over one more key held in registers (k, v: (dim,)), where `holds`
        (this program's span has the step's new position); otherwise the state unchanged. The score as
        `tl.dot` computes it (products of the half-precision values summed in float32), the probability
        rounded to the values' dtype before it weights them, as `_attend` rounds it."""
        s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * (scale * 1.4426950408889634)
        s = tl.where(holds, s, float("-inf"))
        m_new = tl.maximum(m_i, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet and none added: (-inf) - (-inf)
        p = tl.exp2(s - m_safe)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)[None, :]
        return m_new, l_i, acc

    @triton.jit
    def _decode_partials(
        q_ptr,
        k_ptr,
        v_ptr,
        pad_ptr,
        cur_ptr,
        stride_cur,
        end_ptr,
        source_ptr,
        table_ptr,
        stride_tb,
        acc_ptr,
        max_ptr,
        sum_ptr,
        out_ptr,
        stride_ob,
        stride_og,
        stride_oh,
        stride_qb,
        stride_qg,
        stride_qh,
        stride_kb,
        stride_kl,
        stride_kg,
        stride_vb,
        stride_vl,
        stride_vg,
        cos_ptr,
        sin_ptr,
        stride_cb,
        groups,
        splits,
        scale,
        PER_GROUP: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MIN_SPAN: tl.constexpr,
        PAGE: tl.constexpr,
        DIRECT: tl.constexpr,
        SOURCED: tl.constexpr,
        ROPE: tl.constexpr,
    ):
        row_group = tl.program_id(0)
        split = tl.program_id(1)
        row = row_group // groups
        group = row_group % groups
        # the row's own keys [pad, cur] cut into `splits` spans of whole key blocks (>= MIN_SPAN positions):
        # every split of a row does the same work whatever the cache's capacity (trailing splits may be empty)
        first = tl.load(pad_ptr + row)
        end = tl.load(cur_ptr + row * stride_cur) + 1
        span = tl.maximum(tl.cdiv(tl.cdiv(end - first, splits), BLOCK_N) * BLOCK_N, MIN_SPAN)
        lo = first + split * span
        hi = tl.minimum(end, lo + span)

        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        head_ok = offs_h < PER_GROUP
        q_src = q_ptr + row * stride_qb + group * stride_qg
        q = tl.load(q_src + offs_h[:, None] * stride_qh + offs_d[None, :], mask=head_ok[:, None], other=0.0)
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, HEAD_DIM), dtype=tl.float32)
        k_row = k_ptr + row.to(tl.int64) * stride_kb + group * stride_kg  # paged: stride_kb = 0
        v_row = v_ptr + row.to(tl.int64) * stride_vb + group * stride_vg
        if ROPE:  # q_ptr: the raw projection (query heads, key, value per group); RoPE, the K/V write here
            pos = end - 1  # the step's new position: its key attended from registers, written to the cache
            holds = (lo <= pos) & (pos < hi)
            rolled = (offs_d + HEAD_DIM // 2) % HEAD_DIM  # roll(x, dim / 2)[d] = x[(d + dim / 2) mod dim]
            cos = tl.load(cos_ptr + row * stride_cb + offs_d).to(tl.float32)
            sin = tl.load(sin_ptr + row * stride_cb + offs_d).to(tl.float32)
            q_rolled = tl.load(
                q_src + offs_h[:, None] * stride_qh + rolled[None, :], mask=head_ok[:, None], other=0.0
            )
            q = (q.to(tl.float32) * cos[None, :] + q_rolled.to(tl.float32) * sin[None, :]).to(q.dtype)
            k_src = q_src + PER_GROUP * stride_qh
            k_new = (
                tl.load(k_src + offs_d).to(tl.float32) * cos + tl.load(k_src + rolled).to(tl.float32) * sin
            )
            k_new = k_new.to(q.dtype)
            v_new = tl.load(k_src + stride_qh + offs_d)
            m_i, l_i, acc = _attend_new_key(q, k_new, v_new, holds, m_i, l_i, acc, scale)
            if holds:
                if PAGE > 0:
                    at = tl.load(table_ptr + row * stride_tb + pos // PAGE).to(tl.int64) * PAGE + pos % PAGE
                else:
                    at = pos.to(tl.int64)
                tl.store(k_row + at * stride_kl + offs_d, k_new)
                tl.store(v_row + at * stride_vl + offs_d, v_new)
            hi = tl.minimum(hi, pos)  # the cache's keys: the positions before the new one
        own_lo = lo
        if SOURCED:  # positions [lo, prompt end) from the row `source` names: the same K/V as this row's
            src = tl.load(source_ptr + row)
            own_lo = tl.maximum(lo, tl.load(end_ptr + row))
            m_i, l_i, acc = _attend(
                q, k_ptr + src.to(tl.int64) * stride_kb + group * stride_kg,
                v_ptr + src.to(tl.int64) * stride_vb + group * stride_vg, table_ptr + src * stride_tb, lo,
                tl.minimum(hi, own_lo), stride_kl, stride_vl, m_i, l_i, acc, scale, HEAD_DIM, BLOCK_N, PAGE,
            )  # fmt: skip
        m_i, l_i, acc = _attend(
            q, k_row, v_row, table_ptr + row * stride_tb, own_lo, hi, stride_kl, stride_vl, m_i, l_i, acc, scale,
            HEAD_DIM, BLOCK_N, PAGE,
        )  # fmt: skip
        if DIRECT:  # one split: the output itself (a range is never empty: l_i > 0)
            dst = (
                out_ptr + row * stride_ob + group * stride_og + offs_h[:, None] * stride_oh + offs_d[None, :]
            )
            tl.store(dst, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
        else:  # the query heads' states alone (the tile's padding rows are never merged)
            state = (row_group * splits + split) * BLOCK_H + offs_h
            tl.store(acc_ptr + state[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=head_ok[:, None])
            tl.store(max_ptr + state, m_i, mask=head_ok)
            tl.store(sum_ptr + state, l_i, mask=head_ok)

    @triton.jit
    def _merge_splits(
        acc_ptr,
        max_ptr,
        sum_ptr,
        out_ptr,
        stride_ob,
        stride_og,
        stride_oh,
        groups,
        splits,
        BLOCK_H: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """`merge_splits` as one kernel, one program per (row, group, query head) holding all of its splits'
        states as one tile: the states weighted by exp2(their max - the largest), summed, divided, cast to the
        output's dtype."""
        row_group = tl.program_id(0)
        head = tl.program_id(1)
        row = row_group // groups
        group = row_group % groups
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, HEAD_DIM)
        split_ok = offs_s < splits
        state = (row_group * splits + offs_s) * BLOCK_H + head
        m = tl.load(max_ptr + state, mask=split_ok, other=float("-inf"))
        weight = tl.exp2(m - tl.max(m, 0))  # an empty range has max -inf: weight 0
        den = tl.sum(tl.load(sum_ptr + state, mask=split_ok, other=0.0) * weight, 0)
        acc = tl.load(
            acc_ptr + state[:, None] * HEAD_DIM + offs_d[None, :], mask=split_ok[:, None], other=0.0
        )
        out = tl.sum(acc * weight[:, None], 0) / den
        dst = out_ptr + row * stride_ob + group * stride_og + head * stride_oh + offs_d
        tl.store(dst, out.to(out_ptr.dtype.element_ty))


def supported(device: torch.device, dtype: torch.dtype, head_dim: int, per_group: int) -> bool:
    """CUDA sm80+ (bf16 tensor-core dots), half precision (float32 would run `tl.dot` in TF32), a power-of-two
    head dim, <= 64 query heads per KV group; or float16 under Triton's interpreter (`interpreted`)."""
    return (
        dot_supported(device, dtype)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and head_dim <= 256
        and per_group <= 64
    )


MAX_SPLITS = 64  # the merge holds a head's states as one (splits, dim) float32 tile


def num_splits(rows_x_groups: int, cache_len: int, block_n: int, device: torch.device) -> int:
    """Key ranges per (row, group): enough programs for ~4 waves on the GPU's SMs, or ~2 where (row, group)
    pairs alone fill every SM, at most `MAX_SPLITS`, and no more than spans of 4 key blocks (the kernel's
    shortest) would need to cover the cache's capacity. The H200 sweep (scripts/bench/README.md, "Rollout")
    found 4 waves best below one program per SM and 2 above (Qwen2.5-1.5B: 128 rows at 1,400 keys 49 us with
    2 splits, 61 us with the 3 that 4 waves gave; 256 rows at 400 keys 30 us unsplit, 32 us with 2)."""
    return splits_for(rows_x_groups, cache_len, block_n, sm_count(device))  # (the interpreter: a few "SMs")


def splits_for(rows_x_groups: int, cache_len: int, block_n: int, sms: int) -> int:
    """`num_splits` on a GPU of `sms` SMs (scripts/bench/kernel_registers.py plans launches on the CPU)."""
    waves = 2 if rows_x_groups >= sms else 4
    want = max(1, math.ceil(waves * sms / rows_x_groups))
    return max(1, min(want, MAX_SPLITS, cache_len // (4 * block_n)))


_LADDERS = VariantLadders(_decode_partials) if triton is not None else None
"""`occupancy`: per compiled variant of the partials kernel, its ladder of register caps and the caps its
launches took."""


def occupancy_caps() -> list[dict]:
    """What `occupancy` found in this process, one entry per variant: its ladder (programs per SM, cap,
    registers, spilled bytes per rung) and the cap each launch size took (None: uncapped)."""
    return _LADDERS.report(("HEAD_DIM", "PER_GROUP", "PAGE", "SOURCED", "DIRECT", "ROPE")) if _LADDERS else []


def decode_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    pad: torch.Tensor,
    cur: torch.Tensor,
    *,
    table: torch.Tensor | None = None,
    page: int = 0,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    max_registers: int | None = None,
    occupancy: bool = False,
    splits: int | None = None,
    triton_merge: bool = True,
    sourced: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q (rows, groups, heads per group, dim), cache (rows, positions, groups, dim), pad (rows,) int,
    cur (rows,) or (1,) int -> attention output (rows, groups, heads per group, dim) in q's dtype, softmax
    scale 1/sqrt(dim), row r over cache positions [pad[r], cur[r]]. The keyword arguments are the kernel's tuning
    knobs (scripts/bench/decode_attention.py sweeps them; `max_registers`: Triton's `maxnreg`, a cap on the
    partials kernel's registers per thread; `occupancy` without it: the cap engine/rollout/occupancy.py
    `launch_cap` picks for this launch's programs from the variant's ladder of caps); `splits` None:
    `num_splits`. `triton_merge`: the splits' states merged by one Triton kernel (`_merge_splits`), or with one
    split the output written by the partials' kernel itself; False: `merge_splits` compiled (two kernels on an H200), or with one split an
    eager division and cast.

    Paged (`table` (rows, pages per row) int32 and `page` given): the cache is one flat (positions, groups,
    dim) buffer per layer and row r's position n sits at `table[r, n // page] * page + n % page`.

    Sourced (`sourced` = (source, end): (rows,) int each): row r reads its positions before end[r] from row
    source[r], which holds the same K/V there (a sample of the same prompt, prefilled with it), and its
    positions from end[r] on from its own row: the samples of a prompt that all read one copy find it in the
    GPU's L2 cache more often than n copies.

    With `rope` = (cos, sin_signed) ((rows, dim) each, at each row's position `cur[r]`), `q` is the raw fused
    projection (rows, groups, heads per group + 2, dim): each group's query heads, then its key and value
    (engine/rollout/model.py `_projected`). The kernel applies RoPE to the query heads and the key
    (triton_rope_kv.py's arithmetic and rounding), writes the key and the value at position `cur[r]` (the
    program whose span holds it) and attends to that key from registers: triton_rope_kv's kernel and this
    one in one launch."""
    rows, groups, per_group, dim = q.shape
    if rope is not None:
        per_group -= 2
        cos, sin = rope
        if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
            raise ValueError("decode_attention: rope tables need unit stride over dim and one row stride")
    if table is not None:  # the flat cache as one "row" that every row indexes through its page table
        cache_k, cache_v = cache_k.unsqueeze(0), cache_v.unsqueeze(0)
        cache_len, stride_kb, stride_vb, stride_tb = table.shape[1] * page, 0, 0, table.stride(0)
    else:
        cache_len, stride_kb, stride_vb, stride_tb, table, page = cache_k.shape[1], None, None, 0, pad, 0
    cur = cur.expand(rows)  # one position per row (a (1,) tensor: the same for every row, stride 0)
    if q.stride(-1) != 1 or cache_k.stride(-1) != 1 or cache_v.stride(-1) != 1:
        raise ValueError("decode_attention needs unit stride over the head dim")
    block_h = max(16, triton.next_power_of_2(per_group))
    splits = splits or num_splits(rows * groups, cache_len, block_n, q.device)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention: splits={splits}, expected 1..{MAX_SPLITS}")
    direct = triton_merge and splits == 1  # the kernel writes the output: no states, no merge
    out = torch.empty(rows, groups, per_group, dim, dtype=q.dtype, device=q.device) if triton_merge else None
    states = 0 if direct else rows * groups * splits * block_h
    acc = torch.empty(states, dim, dtype=torch.float32, device=q.device)
    m = torch.empty(states, dtype=torch.float32, device=q.device)
    s = torch.empty(states, dtype=torch.float32, device=q.device)
    args = (
        q,
        cache_k,
        cache_v,
        pad,
        cur,
        cur.stride(0),
        pad if sourced is None else sourced[1],
        pad if sourced is None else sourced[0],
        table,
        stride_tb,
        acc,
        m,
        s,
        out if direct else acc,
        *(out.stride()[:3] if direct else (0, 0, 0)),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        cache_k.stride(0) if stride_kb is None else stride_kb,
        cache_k.stride(1),
        cache_k.stride(2),
        cache_v.stride(0) if stride_vb is None else stride_vb,
        cache_v.stride(1),
        cache_v.stride(2),
        cos if rope is not None else q,
        sin if rope is not None else q,
        cos.stride(0) if rope is not None else 0,
        groups,
        splits,
        1.0 / math.sqrt(dim),
    )
    constexprs = dict(
        PER_GROUP=per_group,
        BLOCK_H=block_h,
        HEAD_DIM=dim,
        BLOCK_N=block_n,
        MIN_SPAN=4 * block_n,
        PAGE=page,
        DIRECT=direct,
        SOURCED=sourced is not None,
        ROPE=rope is not None,
    )
    grid = (rows * groups, splits)
    if occupancy and max_registers is None and q.device.type == "cuda":  # (the interpreter has no registers)
        max_registers = _LADDERS.cap(args, constexprs, grid, num_warps, num_stages, q, sm_count(q.device))
    _decode_partials[grid](
        *args,
        **constexprs,
        num_warps=num_warps,
        num_stages=num_stages,
        **({} if max_registers is None else {"maxnreg": max_registers}),
    )
    if direct:
        return out
    if triton_merge:
        _merge_splits[(rows * groups, per_group)](
            acc,
            m,
            s,
            out,
            *out.stride()[:3],
            groups,
            splits,
            BLOCK_H=block_h,
            HEAD_DIM=dim,
            BLOCK_S=max(2, triton.next_power_of_2(splits)),
            num_warps=num_warps,
        )
        return out
    view = (rows, groups, splits, block_h)
    acc, m, s = (
        acc.view(*view, dim)[..., :per_group, :],
        m.view(view)[..., :per_group],
        s.view(view)[..., :per_group],
    )
    if splits == 1:
        return (acc[:, :, 0] / s[:, :, 0, :, None]).to(q.dtype)
    # one compile for every batch width and split count (heads and dim stay constants)
    for t in (acc, m, s):
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, 2)
    return cuda_kernel(merge_splits, q.device, ROLLOUT, dynamic=None)(acc, m, s, q.dtype)


def merge_splits(acc: torch.Tensor, m: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention output from the splits' partial states: acc (rows, groups, splits, heads, dim), running
    max m and sum s (rows, groups, splits, heads) in float32 (base-2 exponents) -> (rows, groups, heads, dim)
    in `dtype`. One compiled kernel on CUDA (eagerly it is six)."""
    weight = torch.exp2(m - m.amax(2, keepdim=True))  # empty ranges: max -inf, weight 0
    out = (acc * weight[..., None]).sum(2) / (s * weight).sum(2)[..., None]
    return out.to(dtype)
