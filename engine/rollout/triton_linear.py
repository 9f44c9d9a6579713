"""A decode step's linear layers at narrow batch widths as a Triton kernel: out = x @ w.T (+ b) for x of a few
rows (the rows still decoding), w the (out, in) weight.

Why: at 8-128 rows a decode step's matmuls are reads of the weights (2 bytes per parameter, ~2 FLOPs per
parameter per row), yet cuBLAS' kernels for these shapes stream them at 1-3.7 TB/s of the H200's 4.8 (a
Qwen2.5-1.5B layer's four matmuls at 8 rows: 40 us for 93 MB, scripts/bench/README.md, "Rollout"): too few
tiles over the output columns to keep every SM reading. Here the weight is the left operand (its rows are the
tile's 64-128 "M" rows, what the tensor cores' shapes want; the few batch rows are the narrow side, padded to
16) and the reduction over `in` is cut into `splits` ranges when the column tiles alone would not fill the
GPU; each range writes float32 partial sums and a second kernel adds them (in a fixed order: deterministic),
the bias and rounds once to the output's dtype.

CUDA sm80+ with Triton, half precision; float16 under the interpreter (tests/engine/interpreted_triton.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.models.triton_support import interpreted, tl, triton

MAX_ROWS = 128
"""Widest batch the kernel takes (wider: cuBLAS' tiles fill the GPU)."""


@dataclass(frozen=True)
class Config:
    block_n: int = 64  # output columns per program (the weight's rows)
    block_k: int = 128
    splits: int = 0  # ranges of `in` (0: enough programs for `WAVES` per SM)
    num_warps: int = 4
    num_stages: int = 4


WAVES = 2
"""Column tiles x splits are chosen to reach this many programs per SM."""

if triton is not None:

    @triton.jit
    def _partials(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        part_ptr,
        rows,
        n,
        k,
        stride_xm,
        stride_wn,
        stride_om,
        k_per_split,
        HAS_BIAS: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        lo = split * k_per_split
        hi = tl.minimum(k, lo + k_per_split)
        n_ok = offs_n < n
        m_ok = offs_m < rows
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        x_rows = x_ptr + offs_m[None, :] * stride_xm
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out.T tile: weight rows x batch rows
        for start in range(lo, hi, BLOCK_K):
            kk = start + offs_k
            k_ok = kk < hi
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_rows + kk[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            acc = tl.dot(w, xt, acc)
        mask = n_ok[:, None] & m_ok[None, :]
        if SPLIT:
            dst = part_ptr + (split * rows + offs_m[None, :]) * n + offs_n[:, None]
            tl.store(dst, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            dst = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sum_splits(
        part_ptr, b_ptr, out_ptr, rows, n, stride_om, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, splits):
            acc += tl.load(part_ptr + (s * rows + row) * n + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The kernel takes this matmul: CUDA sm80+ in half precision (float16 under the interpreter), <= MAX_ROWS
    rows, unit stride over `in` on both sides."""
    if triton is None or x.dtype != w.dtype or x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return False
    on_device = (
        x.device.type == "cuda"
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
        and x.dtype in (torch.bfloat16, torch.float16)
    )
    ok = on_device or (interpreted(x.device) and x.dtype == torch.float16)
    return ok and x.stride(-1) == 1 and w.stride(-1) == 1


def splits_for(n: int, k: int, cfg: Config, device: torch.device) -> int:
    """Ranges of `in`: enough column tiles x splits for `WAVES` programs per SM, each range >= 2 key blocks."""
    if cfg.splits:
        return cfg.splits
    tiles = triton.cdiv(n, cfg.block_n)
    want = triton.cdiv(WAVES * _multiprocessors(device), tiles)
    return max(1, min(want, k // (2 * cfg.block_k)))


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, cfg: Config = Config()
) -> torch.Tensor:
    """x (rows, in) @ w (out, in).T + b (out,) -> (rows, out) in x's dtype, float32 accumulation."""
    rows, k = x.shape
    n = w.shape[0]
    splits = splits_for(n, k, cfg, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    part = torch.empty(splits * rows * n if splits > 1 else 0, dtype=torch.float32, device=x.device)
    bias = b if b is not None else out
    _partials[(triton.cdiv(n, cfg.block_n), splits)](
        x, w, bias, out, part, rows, n, k, x.stride(0), w.stride(0), out.stride(0), k_per_split,
        HAS_BIAS=b is not None, SPLIT=splits > 1, BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_splits[(rows, triton.cdiv(n, block))](
            part, bias, out, rows, n, out.stride(0), splits, HAS_BIAS=b is not None, BLOCK=block, num_warps=4
        )
    return out
