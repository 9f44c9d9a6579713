"""A decode step's token draw from full-vocabulary logits as two Triton kernels: the temperature case without
top-k/top-p (RL's usual sampling).

The torch path (engine/rollout/sampler.py) upcasts the logits to float32, writes the scaled logits and the
probabilities, pads them to whole blocks, sums the blocks, searches two cumulative sums and gathers: ~10
kernels and ~1 GB of traffic per step at 512 rows x 152k columns (1.0 ms per 1.5B decode step on an H200,
~13% of a fixed-length rollout; scripts/bench/README.md). Here the draw is Gumbel-max (token = argmax of
logits / T + G, G = -log(-log(u)) standard Gumbel noise: exactly a draw from softmax(logits / T)), which reads
each logit once, in the model's dtype:

- `_partials`: one program per (row, chunk of columns) streams its logits, keeps per lane the running
  maximum and sum of exponentials (the log-sum-exp, online) and the best noisy key with its column and
  scaled logit; u comes from Philox (`tl.randint4x`: four numbers per counter, keyed by a 64-bit seed drawn
  from the caller's torch.Generator per call, counters distinct per row and column).
- `_combine`: one program per row merges its chunks: log-sum-exp, the token (the largest key; ties: the
  smallest column), its log-prob = scaled logit - log-sum-exp (float32, as the torch path returns it).

Rows split into enough chunks to fill the GPU at narrow widths. Deterministic for a seed (fixed reduction
order), so every TP rank draws the same tokens from the same logits. CUDA with Triton; float16 under the
interpreter (tests/engine/interpreted_triton.py); distribution and log-probs against the torch path:
tests/engine/test_rollout_gpu.py.
"""

from __future__ import annotations

import functools

import torch

from engine.models.triton_support import elementwise_supported, tl, triton

BLOCK = 1024
"""Columns per tile of `_partials` (four Philox outputs per counter: BLOCK / 4 counters per tile)."""
PROGRAMS_PER_SM = 4
"""Chunks per row are chosen so that rows x chunks reaches this many programs per SM."""

if triton is not None:

    @triton.jit
    def _tile(row_ptr, cols, end, inv_temperature, r, m, s, best, best_col, best_x):
        """Fold columns `cols` (u from the Philox output `r`) into the lanes' running statistics."""
        inside = cols < end
        x = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, x)  # m starts finite (-3e38, below any logit): no -inf - (-inf)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        u = tl.uint_to_uniform_float(r)  # [0, 1): scaled so that the largest stays below 1.0 (a key of +inf)
        key = x - tl.log(-tl.log(u))  # x + standard Gumbel noise; u = 0: -inf, never drawn
        better = key > best  # strict: the earliest column of the lane keeps a tie
        return (
            m_new,
            s,
            tl.where(better, key, best),
            tl.where(better, cols, best_col),
            tl.where(better, x, best_x),
        )

    @triton.jit
    def _partials(
        logits_ptr,
        stride_row,
        vocab,
        inv_temperature,
        seed_ptr,
        chunk,
        counters_per_row,
        max_ptr,
        sum_ptr,
        key_ptr,
        col_ptr,
        scaled_ptr,
        chunks,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        c = tl.program_id(1)
        QUARTER: tl.constexpr = BLOCK // 4
        seed = tl.load(seed_ptr)
        lane = tl.arange(0, QUARTER)
        start = c * chunk
        end = tl.minimum(start + chunk, vocab)
        base = row.to(tl.int64) * stride_row
        m = tl.full((QUARTER,), -3.0e38, tl.float32)
        s = tl.zeros((QUARTER,), tl.float32)
        best = tl.full((QUARTER,), float("-inf"), tl.float32)
        bc = tl.zeros((QUARTER,), tl.int32)  # each lane's best column and its scaled logit
        bx = tl.full((QUARTER,), float("-inf"), tl.float32)
        p, t = logits_ptr + base, inv_temperature
        for off in range(start, end, BLOCK):
            # counter off / 4 + lane gives the four numbers of columns off + j * QUARTER + lane, j = 0..3
            counter = row.to(tl.int64) * counters_per_row + off // 4 + lane
            r0, r1, r2, r3 = tl.randint4x(seed, counter)
            m, s, best, bc, bx = _tile(p, off + lane, end, t, r0, m, s, best, bc, bx)
            m, s, best, bc, bx = _tile(p, off + QUARTER + lane, end, t, r1, m, s, best, bc, bx)
            m, s, best, bc, bx = _tile(p, off + 2 * QUARTER + lane, end, t, r2, m, s, best, bc, bx)
            m, s, best, bc, bx = _tile(p, off + 3 * QUARTER + lane, end, t, r3, m, s, best, bc, bx)
        row_max = tl.max(m, axis=0)
        row_sum = tl.sum(s * tl.exp(m - row_max), axis=0)
        top = tl.max(best, axis=0)
        col = tl.min(tl.where(best == top, bc, 2147483647), axis=0)
        x_at = tl.max(tl.where(bc == col, bx, float("-inf")), axis=0)
        out = row * chunks + c
        tl.store(max_ptr + out, row_max)
        tl.store(sum_ptr + out, row_sum)
        tl.store(key_ptr + out, top)
        tl.store(col_ptr + out, col)
        tl.store(scaled_ptr + out, x_at)

    @triton.jit
    def _combine(
        max_ptr, sum_ptr, key_ptr, col_ptr, scaled_ptr, tokens_ptr, logp_ptr, chunks, CHUNKS: tl.constexpr
    ):
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS)
        inside = c < chunks
        at = row * chunks + c
        m = tl.load(max_ptr + at, mask=inside, other=-3.0e38)
        s = tl.load(sum_ptr + at, mask=inside, other=0.0)
        key = tl.load(key_ptr + at, mask=inside, other=float("-inf"))
        col = tl.load(col_ptr + at, mask=inside, other=2147483647)
        x = tl.load(scaled_ptr + at, mask=inside, other=float("-inf"))
        row_max = tl.max(m, axis=0)
        lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))
        top = tl.max(key, axis=0)
        token = tl.min(tl.where(key == top, col, 2147483647), axis=0)
        x_at = tl.max(tl.where(col == token, x, float("-inf")), axis=0)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logp_ptr + row, x_at - lse)


def supported(logits: torch.Tensor) -> bool:
    """The kernels run on these logits: CUDA (any float dtype) or float16 under the interpreter, rows of
    unit column stride."""
    return elementwise_supported(logits.device, logits.dtype) and logits.stride(-1) == 1


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def sample(
    logits_bv: torch.Tensor, inv_temperature: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits_bv` (b, vocab), drawn from softmax(logits * inv_temperature) over the whole
    vocabulary; returns (tokens (b,) int64, their log-probs (b,) float32). One seed per call from `gen`."""
    b, vocab = logits_bv.shape
    dev = logits_bv.device
    tiles = triton.cdiv(vocab, BLOCK)
    chunks = max(1, min(tiles, triton.cdiv(PROGRAMS_PER_SM * _multiprocessors(dev), b)))
    chunk = triton.cdiv(tiles, chunks) * BLOCK
    chunks = triton.cdiv(vocab, chunk)
    seed = torch.randint(0, 2**62, (1,), generator=gen, device=dev)
    part = torch.empty(4, b * chunks, dtype=torch.float32, device=dev)
    cols = torch.empty(b * chunks, dtype=torch.int32, device=dev)
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logp = torch.empty(b, dtype=torch.float32, device=dev)
    counters_per_row = tiles * (BLOCK // 4)
    _partials[(b, chunks)](
        logits_bv, logits_bv.stride(0), vocab, inv_temperature, seed, chunk, counters_per_row,
        part[0], part[1], part[2], cols, part[3], chunks, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    _combine[(b,)](
        part[0], part[1], part[2], cols, part[3], tokens, logp, chunks, CHUNKS=triton.next_power_of_2(chunks)
    )
    return tokens, logp
