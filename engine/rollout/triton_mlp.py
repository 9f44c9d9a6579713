"""A dense layer's MLP at a narrow decode step as two Triton kernels.

At the narrow widths of a long tail's last steps (1-64 rows) a dense MLP ran as fc1 (cuBLAS), SwiGLU
(compiled), fc2 (cuBLAS, split K) and cuBLAS's split-K reduce. Each GEMM only streams its weight once, and
there cuBLAS's narrow tiles leave the SMs unevenly loaded: at 1.5B, width 8, on an H100, fc1 ran at 2.6 TB/s
and fc2 at 1.9 TB/s (scripts/bench/decode_mlp.py). Here the weights are dealt to the SMs evenly:

- `fc1_swiglu`: a grid of a whole number of programs per SM; program p streams fc1's rows [p F / G,
  (p + 1) F / G) of both halves ([gate; up], megatron's fused layout on each TP rank; F rows each, G programs)
  against every row of the step, and writes silu(gate) * up.
- `fc2`: programs over (a range of fc2's output rows, one of `split` equal ranges of its input), again a
  whole number per SM. With `split` > 1 each split writes its own float32 partial sums, (split, rows, hidden):
  no atomics, so the result does not depend on the programs' order. The consumer adds them in a fixed order
  and rounds once (engine/rollout/model.py's `add_partials_rms_norm`).

Rounding as the unfused chain: gate and up rounded to the activation dtype (cuBLAS's outputs), silu(gate) * up
in float32 rounded once (the compiled SwiGLU), fc2's sums rounded once; only the order of the float32 sums in
each dot differs. Parity: tests/engine/interpreted_triton.py (the interpreter, float16: the kernels against
F.linear and SwiGLU, and a tiny checkpoint's decode with them on and off) and
tests/engine/test_decode_kernels_gpu.py, test_rollout_gpu.py (CUDA, bfloat16). CUDA with Triton, or the
interpreter. The engine runs them at rollout.tp=1 only (model.py `RolloutModel.triton_mlp`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.triton_support import sm_count, tl, triton

if triton is not None:

    @triton.jit
    def _fc1_swiglu(
        a_ptr,
        w_ptr,
        h_ptr,
        rows,
        hidden,
        ffn,
        BLOCK_M: tl.constexpr,
        BLOCK_F: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid, programs = tl.program_id(0), tl.num_programs(0)
        lo, hi = pid * ffn // programs, (pid + 1) * ffn // programs
        offs_m = tl.arange(0, BLOCK_M)
        offs_f = lo + tl.arange(0, BLOCK_F)
        m_ok, f_ok = offs_m < rows, offs_f < hi
        acc_g = tl.zeros((BLOCK_M, BLOCK_F), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_F), tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden
            a = tl.load(
                a_ptr + offs_m[:, None] * hidden + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :]
            )
            w_ok = f_ok[:, None] & k_ok[None, :]
            w_at = offs_f[:, None] * hidden + offs_k[None, :]
            gate = tl.load(w_ptr + w_at, mask=w_ok, other=0.0)
            up = tl.load(w_ptr + ffn * hidden + w_at, mask=w_ok, other=0.0)
            acc_g = tl.dot(a, tl.trans(gate), acc_g)
            acc_u = tl.dot(a, tl.trans(up), acc_u)
        dt = h_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        out = g * tl.sigmoid(g) * u
        tl.store(
            h_ptr + offs_m[:, None] * ffn + offs_f[None, :], out.to(dt), mask=m_ok[:, None] & f_ok[None, :]
        )

    @triton.jit
    def _fc2(
        h_ptr,
        w_ptr,
        out_ptr,
        rows,
        ffn,
        hidden,
        per_split,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n, pid_s, programs = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
        lo, hi = pid_n * hidden // programs, (pid_n + 1) * hidden // programs
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = lo + tl.arange(0, BLOCK_N)
        m_ok, n_ok = offs_m < rows, offs_n < hi
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        start = pid_s * per_split
        end = tl.minimum(start + per_split, ffn)
        for k0 in range(start, end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < end
            a_at = h_ptr + offs_m[:, None] * ffn + offs_k[None, :]
            a = tl.load(a_at, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + offs_n[:, None] * ffn + offs_k[None, :], mask=w_ok, other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
        out_at = out_ptr + pid_s * rows * hidden + offs_m[:, None] * hidden + offs_n[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class MlpTiles:
    """Tiles of the two kernels: the most rows of each fc1 half (`block_f`) and of fc2 (`block_n`) one program
    streams (each grid is the fewest whole programs per SM that keep to them), each one's K chunk, fc2's
    split of its input into that many float32 partials, and each kernel's warps and pipeline stages."""

    block_f: int = 32
    block_k1: int = 128
    warps1: int = 4
    stages1: int = 4
    block_n: int = 32
    block_k2: int = 256
    split: int = 4
    warps2: int = 4
    stages2: int = 4

    def __post_init__(self) -> None:
        if self.split < 1:
            raise ValueError(f"split={self.split}: at least 1")
        for name in ("block_f", "block_k1", "block_n", "block_k2"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v}: a power of two >= 16 (Triton's dot)")


MAX_ROWS = 64
"""The widest step the kernels serve: each program holds every row (a 64-row tile at most)."""


def default_tiles(rows: int, hidden: int, ffn: int, device: torch.device) -> MlpTiles:
    """Tiles within 5% of the best of scripts/bench/decode_mlp.py's sweep for each kernel at 0.5B, 1.5B and 7B,
    widths 1-64 (H100; scripts/bench/README.md, "Rollout"): fc1 streams up to 32 rows of each half per program
    at <= 16 rows of the step, 64 in shorter K chunks above; fc2 splits its input until its programs number
    about two per SM (one above 32 rows; 8 splits at most, none empty)."""
    split = min(8, triton.next_power_of_2(triton.cdiv(2 * sm_count(device), triton.cdiv(hidden, 32))))
    split = min(split if rows <= 32 else max(1, split // 2), triton.cdiv(ffn, 128))
    if rows <= 16:
        return MlpTiles(block_f=32, block_k1=128, stages1=3, block_n=32, block_k2=128, split=split)
    return MlpTiles(block_f=64, block_k1=64, stages1=6, block_n=32, block_k2=128, split=split)


def contiguous(*tensors: torch.Tensor) -> bool:
    """The kernels address rows at a stride of their length."""
    return all(t.is_contiguous() for t in tensors)


def _block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def programs_for(rows: int, block: int, per_row_range: int, sms: int) -> int:
    """The fewest ranges of `rows` (at most `block` each) whose programs (each range `per_row_range` times:
    fc2's splits) are a whole number per SM, so that every SM streams the same share of the weight; where no
    few more programs per SM make that whole, one range per `block` rows."""
    per_sm = triton.cdiv(triton.cdiv(rows, block) * per_row_range, sms)
    for programs in range(per_sm * sms, (per_sm + per_row_range) * sms, sms):
        if programs % per_row_range == 0 and programs // per_row_range <= rows:
            return programs // per_row_range
    return triton.cdiv(rows, block)


def fc1_swiglu(h: torch.Tensor, fc1_w: torch.Tensor, tiles: MlpTiles = MlpTiles()) -> torch.Tensor:
    """h (rows, hidden) -> silu(h @ gate.T) * (h @ up.T) (rows, ffn), `fc1_w` = [gate; up] (2 ffn, hidden)."""
    rows, hidden = h.shape
    ffn = fc1_w.shape[0] // 2
    if rows > MAX_ROWS or tuple(fc1_w.shape) != (2 * ffn, hidden) or not contiguous(h, fc1_w):
        raise ValueError(
            f"fc1_swiglu: {tuple(h.shape)} rows against fc1 {tuple(fc1_w.shape)}, both contiguous"
        )
    out = h.new_empty(rows, ffn)
    grid = programs_for(ffn, tiles.block_f, 1, sm_count(h.device))
    _fc1_swiglu[(grid,)](
        h, fc1_w, out, rows, hidden, ffn,
        BLOCK_M=_block_m(rows), BLOCK_F=tiles.block_f, BLOCK_K=tiles.block_k1,
        num_warps=tiles.warps1, num_stages=tiles.stages1,
    )  # fmt: skip
    return out


def fc2(h: torch.Tensor, fc2_w: torch.Tensor, tiles: MlpTiles = MlpTiles()) -> torch.Tensor:
    """h (rows, ffn) @ fc2_w.T (hidden, ffn): (rows, hidden) in h's dtype with `tiles.split` 1, else the float32
    partial sums of each split of ffn, (split, rows, hidden), for the consumer to add in order."""
    rows, ffn = h.shape
    hidden = fc2_w.shape[0]
    if rows > MAX_ROWS or tuple(fc2_w.shape) != (hidden, ffn) or not contiguous(h, fc2_w):
        raise ValueError(f"fc2: {tuple(h.shape)} rows against fc2 {tuple(fc2_w.shape)}, both contiguous")
    split = tiles.split
    out = h.new_empty(rows, hidden) if split == 1 else h.new_empty(split, rows, hidden, dtype=torch.float32)
    per_split = triton.cdiv(triton.cdiv(ffn, split), tiles.block_k2) * tiles.block_k2
    grid = (programs_for(hidden, tiles.block_n, split, sm_count(h.device)), split)
    _fc2[grid](
        h, fc2_w, out, rows, ffn, hidden, per_split,
        BLOCK_M=_block_m(rows), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k2,
        num_warps=tiles.warps2, num_stages=tiles.stages2,
    )  # fmt: skip
    return out


def decode_mlp(h: torch.Tensor, fc1_w: torch.Tensor, fc2_w: torch.Tensor) -> torch.Tensor:
    """The MLP on normed hidden states h (..., hidden), at most `MAX_ROWS` rows, with `default_tiles`:
    (..., hidden) in h's dtype, or (split, ..., hidden) float32 partial sums."""
    rows, hidden = h.numel() // h.shape[-1], h.shape[-1]
    tiles = default_tiles(rows, hidden, fc2_w.shape[1], h.device)
    out = dense_mlp(h.reshape(rows, hidden), fc1_w, fc2_w, tiles)
    return out.view(*out.shape[:-2], *h.shape)


def dense_mlp(
    h: torch.Tensor, fc1_w: torch.Tensor, fc2_w: torch.Tensor, tiles: MlpTiles = MlpTiles()
) -> torch.Tensor:
    """The MLP on normed rows h (rows, hidden): `fc2`'s output (the partial sums with a split)."""
    return fc2(fc1_swiglu(h, fc1_w, tiles), fc2_w, tiles)
