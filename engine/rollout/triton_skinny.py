"""The decode step's linear layers for a few rows (a long tail's narrow batches) as one Triton kernel each.

At the narrow widths where a long tail spends most of its decode steps, a linear layer `x (m, in) @ w (out,
in).T` is a read of the weight: it should run at HBM bandwidth. cuBLAS does not get there for the decode
shapes of small models: at 8 rows the 1.5B QKV and output projections (6.3 and 4.7 MB) take ~5 us each (~1
TB/s), fc2 reads at 2.4 TB/s plus a split-K reduce kernel (scripts/bench/README.md, "a narrow-step profile").
Here each program owns `BLOCK_N` output columns (and with `SPLIT_K` > 1 one slice of the input features),
streams that block of weight rows once and multiplies it with all rows of `x` on the tensor cores (the rows
padded to a 16-row tile); float32 accumulation, the bias added in float32, one rounding to the output dtype.

Split K without a second kernel: each of a column block's `SPLIT_K` programs writes its float32 partial sums
to a workspace and takes a ticket from the block's counter (an atomic add, acquire-release); the program that
draws the last ticket sums the partials in a fixed order (split 0 first: the same result whichever program
finishes last), adds the bias, stores, and resets the counter to 0 for the next call. The counters are one
persistent int32 buffer per device: kernels of one stream run one after another, so two calls never share
them at once; the engine's decode runs on one stream.

`linear` picks the kernel where it applies (CUDA with Triton, half precision, at most `SKINNY_MAX_ROWS` rows,
contiguous operands) and `F.linear` elsewhere. The tile per shape comes from `skinny_config`. Measured on
one H200: scripts/bench/README.md ("Rollout"). Parity: tests/engine/interpreted_triton.py (CPU, float16,
against float32 matmuls) and tests/engine/test_rollout_gpu.py (bf16 against cuBLAS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.triton_support import interpreted, tl, triton

SKINNY_MAX_ROWS = 64
"""The widest batch the skinny kernel serves; wider GEMMs are compute-bound and go to cuBLAS."""

if triton is not None:

    @triton.jit
    def _skinny_linear(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        part_ptr,
        count_ptr,
        M,
        N,
        K,
        k_span,
        stride_xm,
        stride_wn,
        stride_ym,
        split_k,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        in_m, in_n = offs_m < M, offs_n < N
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = pid_k * k_span
        k_hi = tl.minimum(k_lo + k_span, K)
        for k in range(k_lo, k_hi, BLOCK_K):
            ks = k + offs_k
            in_k = ks < k_hi
            x = tl.load(x_rows + ks[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        tile = offs_m[:, None] * N + offs_n[None, :]
        inside = in_m[:, None] & in_n[None, :]
        if split_k > 1:
            tl.store(part_ptr + pid_k * M * N + tile, acc, mask=inside)
            ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if ticket == split_k - 1:  # the last split of this column block sums them all, in split order
                acc = tl.load(part_ptr + tile, mask=inside, other=0.0, cache_modifier=".cg")
                for s in range(1, split_k):
                    acc += tl.load(part_ptr + s * M * N + tile, mask=inside, other=0.0, cache_modifier=".cg")
                tl.store(count_ptr + pid_n, 0)
                _store_output(acc, b_ptr, y_ptr, offs_m, offs_n, in_n, inside, stride_ym, HAS_BIAS)
        else:
            _store_output(acc, b_ptr, y_ptr, offs_m, offs_n, in_n, inside, stride_ym, HAS_BIAS)

    @triton.jit
    def _store_output(acc, b_ptr, y_ptr, offs_m, offs_n, in_n, inside, stride_ym, HAS_BIAS: tl.constexpr):
        """The bias added in float32, one rounding to the output's dtype."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=inside)


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch's tile: output columns per program, input features per step, programs per column block
    (split K), warps, pipeline stages."""

    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def skinny_config(m: int, n: int, k: int, sms: int = 132) -> SkinnyConfig:
    """The tile for an (m, k) x (k, n) decode GEMM on a GPU of `sms` multiprocessors: column blocks of 16-64
    so that there are enough programs for every SM, and split K where the column blocks alone are too few."""
    block_n = 64 if n >= 64 * sms else (32 if n >= 32 * sms else 16)
    blocks = triton.cdiv(n, block_n) if triton is not None else -(-n // block_n)
    split_k = 1
    while blocks * split_k < 2 * sms and k // (split_k * 2) >= 512:
        split_k *= 2
    return SkinnyConfig(block_n=block_n, block_k=256 if k >= 256 else 64, split_k=split_k)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    """The per-device split-K tickets (zero between calls: the last program of a block resets its counter)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < blocks:
        have = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = have
    return have


def skinny_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The skinny kernel serves `F.linear(x, weight)` here: Triton on CUDA (or its interpreter on CPU, float16
    only), a half-precision activation and weight of one dtype, at most `SKINNY_MAX_ROWS` rows, unit stride over
    the input features."""
    if triton is None or x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not (x.is_cuda or (interpreted(x.device) and x.dtype == torch.float16)):
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return 0 < rows <= SKINNY_MAX_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x (..., in) of at most `SKINNY_MAX_ROWS` rows, weight (out, in), by the
    Triton kernel; float32 accumulation, one rounding. No host synchronisation: capturable in a CUDA graph."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        config = skinny_config(m, n, k, sms)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(n, config.block_n)
    split_k = max(1, min(config.split_k, triton.cdiv(k, config.block_k)))
    k_span = triton.cdiv(triton.cdiv(k, split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(k, k_span)  # no empty splits
    if split_k > 1:
        part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        count = _counters(x.device, blocks)
    else:
        part = count = y  # not read
    _skinny_linear[(blocks, split_k)](
        x2,
        weight,
        bias if bias is not None else y,
        y,
        part,
        count,
        m,
        n,
        k,
        k_span,
        x2.stride(0),
        weight.stride(0),
        y.stride(0),
        split_k,
        HAS_BIAS=bias is not None,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return y.view(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, by the skinny kernel where it applies (`skinny_supported`)."""
    if skinny_supported(x, weight):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
