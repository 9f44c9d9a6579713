"""A decode step's token draw from full-vocabulary logits as two Triton kernels: the temperature case without
top-k/top-p (RL's usual sampling).

The torch path (engine/rollout/sampler.py) upcasts the logits to float32, writes the scaled logits and the
probabilities, pads them to whole blocks, sums the blocks, searches two cumulative sums and gathers: ~10
kernels and ~1 GB of traffic per step at 512 rows x 152k columns (1.0 ms per 1.5B decode step on an H200,
~13% of a fixed-length rollout; scripts/bench/README.md). Here the same two-level inverse CDF reads each logit
once in the model's dtype, plus one tile of it again:

- `_tile_stats`: one program per (row, chunk of columns) computes, for each tile of `TILE` columns, the
  maximum of logits / T and the sum of exp(logit / T - that maximum), in float32.
- `_draw`: one program per row merges its tiles' statistics into the log-sum-exp, draws a tile with
  probability (its mass / the row's) from one uniform number, re-reads that tile alone and draws the column
  inside it with probability (its weight / the tile's mass) from a second one: exactly a draw from
  softmax(logits / T), with each level's float32 resolution relative to its own mass (one number for both
  levels, as the torch path, resolves the inner draw only to the whole row's). The log-prob = the token's
  logit / T - log-sum-exp (float32, as the torch path returns it).

Both draws pick the first entry whose cumulative weight reaches u x total for u in (0, 1], so an entry of zero
weight (a -inf logit, a tile past the vocabulary) is never drawn. The two uniform numbers come from Philox
(`tl.randint4x`) keyed by a 62-bit seed drawn from the caller's torch.Generator per call and counted by row:
deterministic for a seed (fixed reduction orders), so every TP rank draws the same tokens from the same logits.
Until 2026-12 the draw here was Gumbel-max (Philox and two logarithms per logit): compute-bound, 419 us per
draw at 512 rows against ~35 us for reading the logits (scripts/bench/README.md, "Rollout").

CUDA with Triton; float16 under the interpreter (tests/engine/interpreted_triton.py); distribution and
log-probs against softmax: tests/engine/test_rollout_gpu.py.
"""

from __future__ import annotations

import torch

from engine.models.triton_support import elementwise_supported, sm_count, tl, triton

TILE = 2048
"""Columns per tile: the unit of `_tile_stats`' statistics and of the column draw's second read."""
PROGRAMS_PER_SM = 4
"""Chunks per row are chosen so that rows x chunks reaches this many programs per SM."""

if triton is not None:

    @triton.jit
    def _tile_stats(
        logits_ptr, stride_row, vocab, inv_temperature, chunk, tiles, max_ptr, sum_ptr, TILE: tl.constexpr
    ):
        row = tl.program_id(0)
        start = tl.program_id(1) * chunk
        end = tl.minimum(start + chunk, vocab)
        cols = tl.arange(0, TILE)
        p = logits_ptr + row.to(tl.int64) * stride_row
        for off in range(start, end, TILE):
            at = off + cols
            x = tl.load(p + at, mask=at < end, other=float("-inf")).to(tl.float32) * inv_temperature
            m = tl.maximum(tl.max(x, axis=0), -3.0e38)  # finite: a tile of -inf logits has mass 0, not NaN
            out = row * tiles + off // TILE
            tl.store(max_ptr + out, m)
            tl.store(sum_ptr + out, tl.sum(tl.exp(x - m), axis=0))

    @triton.jit
    def _first_reaching(cdf, u, index, size):
        """The first index whose cumulative weight `cdf` reaches u x the total (the last entry), u in (0, 1]."""
        total = tl.max(tl.where(index == size - 1, cdf, 0.0), axis=0)
        return tl.sum((cdf < u * total).to(tl.int32), axis=0)

    @triton.jit
    def _draw(
        logits_ptr,
        stride_row,
        vocab,
        inv_temperature,
        seed_ptr,
        max_ptr,
        sum_ptr,
        tiles,
        tokens_ptr,
        logp_ptr,
        TILE: tl.constexpr,
        TILES: tl.constexpr,
    ):
        row = tl.program_id(0)
        r0, r1, _, _ = tl.randint4x(tl.load(seed_ptr), row)
        u_tile = 1.0 - tl.uint_to_uniform_float(r0)  # (0, 1]
        u_col = 1.0 - tl.uint_to_uniform_float(r1)
        t = tl.arange(0, TILES)
        m = tl.load(max_ptr + row * tiles + t, mask=t < tiles, other=-3.0e38)
        s = tl.load(sum_ptr + row * tiles + t, mask=t < tiles, other=0.0)
        row_max = tl.max(m, axis=0)
        mass = s * tl.exp(m - row_max)
        lse = row_max + tl.log(tl.sum(mass, axis=0))
        tile = _first_reaching(tl.cumsum(mass, axis=0), u_tile, t, TILES)
        tile_max = tl.max(tl.where(t == tile, m, -3.0e38), axis=0)
        at = tile * TILE + tl.arange(0, TILE)
        p = logits_ptr + row.to(tl.int64) * stride_row
        x = tl.load(p + at, mask=at < vocab, other=float("-inf")).to(tl.float32) * inv_temperature
        col = _first_reaching(tl.cumsum(tl.exp(x - tile_max), axis=0), u_col, at - tile * TILE, TILE)
        x_at = tl.max(tl.where(at == tile * TILE + col, x, float("-inf")), axis=0)
        tl.store(tokens_ptr + row, (tile * TILE + col).to(tl.int64))
        tl.store(logp_ptr + row, x_at - lse)


def supported(logits: torch.Tensor) -> bool:
    """The kernels run on these logits: CUDA (any float dtype) or float16 under the interpreter, rows of
    unit column stride."""
    return elementwise_supported(logits.device, logits.dtype) and logits.stride(-1) == 1


def sample(
    logits_bv: torch.Tensor, inv_temperature: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits_bv` (b, vocab), drawn from softmax(logits * inv_temperature) over the whole
    vocabulary; returns (tokens (b,) int64, their log-probs (b,) float32). One seed per call from `gen`."""
    b, vocab = logits_bv.shape
    dev = logits_bv.device
    tiles = triton.cdiv(vocab, TILE)
    chunks = max(1, min(tiles, triton.cdiv(PROGRAMS_PER_SM * sm_count(dev), b)))
    chunk = triton.cdiv(tiles, chunks) * TILE
    seed = torch.randint(0, 2**62, (1,), generator=gen, device=dev)
    stats = torch.empty(2, b * tiles, dtype=torch.float32, device=dev)
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logp = torch.empty(b, dtype=torch.float32, device=dev)
    stride, t = logits_bv.stride(0), inv_temperature
    _tile_stats[(b, triton.cdiv(vocab, chunk))](
        logits_bv, stride, vocab, t, chunk, tiles, stats[0], stats[1], TILE=TILE, num_warps=4
    )
    _draw[(b,)](
        logits_bv, stride, vocab, t, seed, stats[0], stats[1], tiles, tokens, logp,
        TILE=TILE, TILES=max(2, triton.next_power_of_2(tiles)), num_warps=4,
    )  # fmt: skip
    return tokens, logp
