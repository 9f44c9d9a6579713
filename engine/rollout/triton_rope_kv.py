"""RoPE and the K/V cache writes of a decode step as one Triton kernel.

The decode step of a layer used three small kernels between the QKV projection and the attention: RoPE on the
query heads and the key (compiled), then one indexed write each for the key and the value. At the narrow
batches of a long tail each is a few microseconds of launch and ramp for a few kilobytes of data, times the
layers, every step (scripts/bench/README.md, "1.5B, long tail to 16,384": ~11 us of ~99 per layer-step).
Here one program per (row, KV group) reads the group's slice of the fused projection once, rotates the
query heads and the key in float32 (x * cos + roll(x, dim / 2) * sin_signed, rounded once to the
activation dtype, as the compiled `apply_rope` of engine/rollout/rope.py computes it), writes the query heads
out and the key and the value into the cache at the row's position.

The cache addressing covers both layouts of engine/rollout/model.py `decode`: contiguous rows (row r's
position n at `r * row stride + n * position stride`) and the paged flat buffer (row stride 0, `at[r]` the
flat position). CUDA with Triton only; parity with the unfused chain: tests/engine/test_rollout_gpu.py.
With the Triton decode attention the same work runs inside its kernel (triton_decode.py `rope`); this kernel
serves the flash attention and `DecodeKernels(rope_in_attention=False)`.
"""

from __future__ import annotations

import torch

from engine.models.triton_support import tl, triton

if triton is not None:

    @triton.jit
    def _rope_write_kv(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        at_ptr,
        stride_at,
        stride_xb,
        stride_xg,
        stride_xh,
        stride_cb,
        stride_qb,
        stride_qg,
        stride_qh,
        stride_kb,
        stride_kl,
        stride_kg,
        stride_vb,
        stride_vl,
        stride_vg,
        groups,
        PER_GROUP: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row = pid // groups
        group = pid % groups
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        rolled = (offs_d + HEAD_DIM // 2) % HEAD_DIM  # roll(x, dim / 2)[d] = x[(d + dim / 2) mod dim]
        roped = offs_h < PER_GROUP + 1  # the query heads, then the key
        src = qkv_ptr + row * stride_xb + group * stride_xg + offs_h[:, None] * stride_xh
        x = tl.load(src + offs_d[None, :], mask=roped[:, None], other=0.0)
        x_rolled = tl.load(src + rolled[None, :], mask=roped[:, None], other=0.0)
        cos = tl.load(cos_ptr + row * stride_cb + offs_d).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_cb + offs_d).to(tl.float32)
        y = x.to(tl.float32) * cos[None, :] + x_rolled.to(tl.float32) * sin[None, :]
        y = y.to(x.dtype)
        dst_q = q_ptr + row * stride_qb + group * stride_qg + offs_h[:, None] * stride_qh + offs_d[None, :]
        tl.store(dst_q, y, mask=(offs_h < PER_GROUP)[:, None])
        at = tl.load(at_ptr + row * stride_at).to(tl.int64)
        dst_k = k_cache_ptr + row.to(tl.int64) * stride_kb + at * stride_kl + group * stride_kg
        # every tile row points at the key's slot; only the key's row (index PER_GROUP) is stored
        tl.store(dst_k + (offs_h * 0)[:, None] + offs_d[None, :], y, mask=(offs_h == PER_GROUP)[:, None])
        v = tl.load(qkv_ptr + row * stride_xb + group * stride_xg + (PER_GROUP + 1) * stride_xh + offs_d)
        dst_v = v_cache_ptr + row.to(tl.int64) * stride_vb + at * stride_vl + group * stride_vg
        tl.store(dst_v + offs_d, v)


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    at: torch.Tensor,
    paged: bool,
) -> torch.Tensor:
    """qkv (rows, groups, heads per group + 2, dim): each group's query heads, key and value as the fused
    projection lays them out (unit stride over dim); cos and sin_signed (rows, dim) at each row's position.
    Writes the rotated key and the value at position `at[r]` of row r: the cache (rows, positions, groups, dim)
    with `paged` False, else the flat (positions, groups, dim) buffer and `at[r]` a flat position. Returns the
    rotated query heads, (rows, groups, heads per group, dim)."""
    rows, groups, width, dim = qkv.shape
    per_group = width - 2
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin_signed.stride(-1) != 1:
        raise ValueError("rope_write_kv needs unit stride over the head dim")
    if cache_k.stride(-1) != 1 or cache_v.stride(-1) != 1:
        raise ValueError("rope_write_kv needs caches with unit stride over the head dim")
    if paged:  # the flat buffer as one row that every row indexes by its flat position
        cache_k, cache_v = cache_k.unsqueeze(0), cache_v.unsqueeze(0)
        stride_kb = stride_vb = 0
    else:
        stride_kb, stride_vb = cache_k.stride(0), cache_v.stride(0)
    q = torch.empty(rows, groups, per_group, dim, dtype=qkv.dtype, device=qkv.device)
    at = at.expand(rows)
    _rope_write_kv[(rows * groups,)](
        qkv,
        cos,
        sin_signed,
        q,
        cache_k,
        cache_v,
        at,
        at.stride(0),
        qkv.stride(0),
        qkv.stride(1),
        qkv.stride(2),
        cos.stride(0),
        *q.stride()[:3],
        stride_kb,
        cache_k.stride(1),
        cache_k.stride(2),
        stride_vb,
        cache_v.stride(1),
        cache_v.stride(2),
        groups,
        PER_GROUP=per_group,
        BLOCK_H=triton.next_power_of_2(per_group + 1),
        HEAD_DIM=dim,
        num_warps=4,
    )
    return q
