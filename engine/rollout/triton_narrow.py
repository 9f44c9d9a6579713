"""A narrow decode step's projections and residual add + RMSNorms as Triton kernels, launched with programmatic
dependent launch (PDL) where the GPU has it.

At <= 64 rows a layer's QKV and output projections each stream a few MB of weights (cuBLAS: 4-6 us each at
1.5B), and the two residual adds + RMSNorms are compiled kernels of a few microseconds more. Here:

- `linear`: x (rows, K) @ w.T (N, K) with the weights dealt to the SMs evenly (triton_mlp.py's grid rule:
  programs over ranges of w's rows, a whole number per SM, times `split` equal ranges of K); with `split` 1 the
  output in x's dtype (plus an optional bias, added to the float32 sums before the one rounding, as cuBLAS's
  epilogue), else each split's float32 partial sums (split, rows, N), no atomics, for the consumer to add in
  a fixed order;
- `add_norm`: s = x + y, rms_norm(s) * weight, one program per row; y is a tensor of x's shape or the float32
  partials of `linear`/triton_mlp's `fc2`, added in order and rounded once first. Rounded as
  engine/rollout/model.py's `add_rms_norm` / `add_partials_rms_norm`.

PDL (`pdl=True`, CUDA sm90+ only: `pdl_supported`): each kernel is launched with the programmatic-serialization
attribute, so that its programs may start while the kernel before it still runs; every program waits
(`gdc_wait`: the previous kernel has finished and its writes are visible) before it reads or writes anything but
its own weights, then lets the next kernel launch (`gdc_launch_dependents`). Nothing is written before the
wait, so a buffer the previous kernel still reads is never overwritten. Where the kernels before and after are
not launched with PDL (cuBLAS, compiled kernels, the attention) it changes nothing.

Parity: tests/engine/interpreted_triton.py (the interpreter, float16: against F.linear and the norms; a tiny
checkpoint's decode with the narrow kernels on and off) and tests/engine/test_decode_kernels_gpu.py (CUDA,
bfloat16, PDL on). Measured: scripts/bench/decode_pdl.py, scripts/bench/README.md ("Rollout").
"""

from __future__ import annotations

import torch

from engine.models.triton_support import sm_count, tl, triton
from engine.rollout.triton_mlp import MAX_ROWS, contiguous, launch_options, programs_for

if triton is not None:

    @triton.jit
    def _linear(
        x_ptr, w_ptr, b_ptr, out_ptr, rows, K, N, per_split,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        pid_n, pid_s, programs = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
        lo, hi = pid_n * N // programs, (pid_n + 1) * N // programs
        start = pid_s * per_split
        end = tl.minimum(start + per_split, K)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = lo + tl.arange(0, BLOCK_N)
        m_ok, n_ok = offs_m < rows, offs_n < hi
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(start, end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < end
            a = tl.load(
                x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            w = tl.load(
                w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
            )
            acc = tl.dot(a, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_at = out_ptr + pid_s * rows * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip

    @triton.jit
    def _add_norm(
        x_ptr, y_ptr, w_ptr, s_ptr, h_ptr, rows, hidden, eps,
        PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < hidden
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(x_ptr + row * hidden + offs, mask=ok, other=0.0)
        dt = x.dtype
        if PARTS > 0:  # the float32 partial sums in order, rounded once
            y32 = tl.zeros((BLOCK,), tl.float32)
            for p in tl.static_range(PARTS):
                y32 += tl.load(y_ptr + (p * rows + row) * hidden + offs, mask=ok, other=0.0)
            y = y32.to(dt)
        else:
            y = tl.load(y_ptr + row * hidden + offs, mask=ok, other=0.0)
        s = (x.to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(s_ptr + row * hidden + offs, s, mask=ok)
        sf = s.to(tl.float32)
        normed = (sf / tl.sqrt(tl.sum(sf * sf, 0) / hidden + eps)).to(dt)
        tl.store(h_ptr + row * hidden + offs, (normed.to(tl.float32) * w.to(tl.float32)).to(dt), mask=ok)


BLOCK_N, BLOCK_K, WARPS, STAGES = 32, 128, 4, 4
"""`linear`'s tile: up to 32 rows of w per program, K in chunks of 128, 4 pipeline stages."""


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch runs here: CUDA sm90+ (Hopper) with Triton."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """The kernels take x's rows: at most `MAX_ROWS` of them, x and the weights contiguous."""
    return x.numel() <= MAX_ROWS * x.shape[-1] and contiguous(x, *weights)


def linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, split: int = 1, pdl: bool = False
) -> torch.Tensor:
    """x (..., K) @ w.T (+ bias): (..., N) in x's dtype with `split` 1, else (split, ..., N) float32 partial sums
    (no bias). `applies(x, w)` must hold."""
    K, N = x.shape[-1], w.shape[0]
    rows = x.numel() // K
    if (
        rows > MAX_ROWS
        or tuple(w.shape) != (N, K)
        or not contiguous(x, w)
        or (bias is not None and split > 1)
    ):
        raise ValueError(f"linear: {tuple(x.shape)} against {tuple(w.shape)}, both contiguous, bias unsplit")
    lead = x.shape[:-1]
    out = x.new_empty(*lead, N) if split == 1 else x.new_empty(split, *lead, N, dtype=torch.float32)
    if rows == 0:
        return out
    per_split = triton.cdiv(triton.cdiv(K, split), BLOCK_K) * BLOCK_K
    grid = (programs_for(N, BLOCK_N, split, sm_count(x.device)), split)
    _linear[grid](
        x, w, bias if bias is not None else w, out, rows, K, N, per_split, HAS_BIAS=bias is not None,
        BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PDL=pdl,
        num_warps=WARPS, num_stages=STAGES, **launch_options(pdl),
    )  # fmt: skip
    return out


def add_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rms_norm(x + y) * weight) for x (..., hidden) contiguous and y of x's shape or (parts, *x.shape)
    float32 partial sums."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    parts = y.shape[0] if y.dim() > x.dim() else 0
    if tuple(y.shape[-x.dim() :]) != tuple(x.shape) or not contiguous(x, y, weight):
        raise ValueError(f"add_norm: {tuple(x.shape)} and {tuple(y.shape)}, contiguous")
    s, h = torch.empty_like(x), torch.empty_like(x)
    if rows == 0:
        return s, h
    _add_norm[(rows,)](
        x, y, weight, s, h, rows, hidden, eps, PARTS=parts, BLOCK=triton.next_power_of_2(hidden), PDL=pdl,
        num_warps=4, **launch_options(pdl),
    )  # fmt: skip
    return s, h
