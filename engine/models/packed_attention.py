"""The update's causal attention kernels: within each row of a packed micro-batch (rows back to back,
megatron's thd `PackedSeqParams`: q (t, heads, dim), k/v (t, groups, dim) -> (t, heads, dim), `packed_attention`)
and over a padded micro-batch (q (b, heads, s, dim), k/v (b, groups, s, dim), `padded_attention`).

Three paths, each exact causal attention within a row; the first that applies runs:
- Every row as long as the longest (`rows x max_seqlen == t`, read from the host-side shapes, no sync): the
  packed tokens are already a (rows, longest) batch, so SDPA runs on views of it. A fixed-length batch packs
  this way. On CUDA in half precision SDPA runs cuDNN's attention, which on an H200 takes 0.60-0.65x
  FlashAttention-2's time forward and backward at 768-token rows, but builds a plan for each new shape on its
  first call (127-293 ms measured, some over a second; `scripts/bench/packed_attention.py`): the gain of
  ~220-800 layer calls (0.37 ms per layer and micro-batch at 0.5B, 0.59 ms at 1.5B). So a shape goes to cuDNN
  from its `CUDNN_FROM_CALL`-th call in the process on (each layer's call counts; `RecurringShapes`),
  FlashAttention-2 before (the ski-rental rule: rent until the rent paid would have bought): a fixed-length
  run switches in its second step, a micro-batch whose equal rows are a rare shape (two samples of one prompt
  both cut at the limit) never pays a build.
- On CUDA in bfloat16/float16 without dropout: FlashAttention-2 varlen through torch's aten ops, the key/value
  groups as they are (the kernel maps each query head to its group; the backward writes key/value gradients
  per query head and FlashAttention's wrapper then sums each group's: two bf16 reductions per layer, ~0.6%
  of the 1.5B update's kernel time at 32,768-token micro-batches, `scripts/bench/results/
  profile_update_1_5b_512x768_packed_h200.txt`). torch's `varlen_attn` before 2.13 has no `enable_gqa`, and
  repeating the groups per query head cost a copy of k and v each way as well.
- Elsewhere: SDPA over the rows, those of one length in one batched call (`segment_attention`; one host sync
  for the row lengths).

A padded micro-batch (trainer.pack_sequences=false) under a token budget is cut to its own longest row, so its
(b, s) changes with nearly every micro-batch of a long-tailed step (without a budget every micro-batch is as
long as the batch's longest row). It takes the same rule: SDPA without its cuDNN backend (FlashAttention-2 on
CUDA in half precision) until the shape recurs, cuDNN from its `CUDNN_FROM_CALL`-th call.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch.nn.attention import SDPBackend, sdpa_kernel

WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA's backends for a shape not yet recurring: its priority order with cuDNN left out."""


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: PackedSeqParams,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each packed row (module docstring); rows bounded by `params.cu_seqlens_q`
    (the same for keys), none longer than `params.max_seqlen_q`."""
    rows, longest = params.cu_seqlens_q.numel() - 1, params.max_seqlen_q
    flash = flash_applies(q, dropout_p)
    if rows * longest == q.shape[0]:  # lengths <= longest summing to rows x longest: all equal
        shape = (rows, longest, *q.shape[1:], k.shape[1], q.dtype, torch.is_grad_enabled())
        if not flash or RECURRING(shape):
            return uniform_rows_attention(q, k, v, rows, scale, dropout_p)
    if flash:
        return FlashVarlen.apply(q, k, v, params.cu_seqlens_q, longest, scale)
    return segment_attention(q, k, v, params.cu_seqlens_q, params.cu_seqlens_q, scale, dropout_p)


CUDNN_FROM_CALL = 512
"""The call of a (rows, longest, heads, ...) shape, counting every layer's, from which equal rows go to cuDNN
(module docstring)."""


class RecurringShapes:
    """Counts the calls per shape in this process; True from a shape's `CUDNN_FROM_CALL`-th call on. A call
    while a CUDA graph is captured takes cuDNN only if an eager call already did (its plan is built outside
    the capture); the graph's replays count instead (`replayed`)."""

    def __init__(self):
        self.calls: dict[tuple, int] = {}
        self.captured: list[tuple] = []
        """Shapes asked for while capturing, in order: the capturer takes them (`replayed` counts replays)."""

    def __call__(self, shape: tuple) -> bool:
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing:  # a CUDA graph (layer_graphs.py): never the plan's build
            self.captured.append(shape)
            return self.calls.get(shape, 0) >= CUDNN_FROM_CALL  # cuDNN only where an eager call built it
        self.calls[shape] = self.calls.get(shape, 0) + 1
        return self.calls[shape] >= CUDNN_FROM_CALL

    def replayed(self, shapes: list[tuple]) -> None:
        """Count a replay of a graph that captured calls of `shapes` as those calls: a shape whose graphs
        replay often goes to cuDNN when it is next run eagerly and captured again."""
        for shape in shapes:
            self.calls[shape] = self.calls.get(shape, 0) + 1


RECURRING = RecurringShapes()


def padded_attention(q, k, v, scale: float | None, dropout_p: float) -> torch.Tensor:
    """Causal SDPA over a padded batch, q (b, heads, s, dim) and k/v (b, groups, s, dim): on CUDA without
    cuDNN until the shape recurs (`RecurringShapes`), with SDPA's own choice from then on (module docstring)."""
    if q.is_cuda:
        shape = ("padded", *q.shape, k.shape[1], q.dtype, torch.is_grad_enabled())
        if not RECURRING(shape):
            with sdpa_kernel(WITHOUT_CUDNN):
                return causal_sdpa(q, k, v, scale, dropout_p)
    return causal_sdpa(q, k, v, scale, dropout_p)


def causal_sdpa(q, k, v, scale: float | None, dropout_p: float) -> torch.Tensor:
    """SDPA, causal, over (b, heads, s, dim) with key/value groups dividing the heads."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def flash_applies(q: torch.Tensor, dropout_p: float) -> bool:
    """Where torch's FlashAttention-2 kernels run: CUDA, half precision, no dropout."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and dropout_p == 0.0


def uniform_rows_attention(q, k, v, rows: int, scale: float | None, dropout_p: float) -> torch.Tensor:
    """Causal SDPA over `rows` rows of equal length lying back to back: (rows, heads, length, dim) views."""
    q4, k4, v4 = (x.unflatten(0, (rows, -1)).transpose(1, 2) for x in (q, k, v))
    out = causal_sdpa(q4, k4, v4, scale, dropout_p)
    return out.transpose(1, 2).flatten(0, 1)


def segment_attention(q, k, v, cu_q, cu_k, scale: float | None, dropout_p: float) -> torch.Tensor:
    """SDPA over segments, query i of a segment of Q queries and K keys attending to keys j <= K - Q + i
    (causal, aligned to the end of the keys; K = Q: causal within a row), key/value groups dividing the heads:
    the segments of one (Q, K) shape in one batched call (one host sync for the lengths). Where the cheap
    kernels do not run (the CPU, float32): a fixed-length batch is a few calls instead of one per row."""
    q_lens, k_lens = cu_q.diff().tolist(), cu_k.diff().tolist()
    q_starts, k_starts = ([0, *itertools.accumulate(n)][:-1] for n in (q_lens, k_lens))
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(zip(q_lens, k_lens)):
        if shape[0]:
            by_shape.setdefault(shape, []).append(i)
    outs, order = [], []
    for (nq, nk), segments in by_shape.items():
        q_idx = torch.tensor([q_starts[i] for i in segments])[:, None] + torch.arange(nq)
        k_idx = torch.tensor([k_starts[i] for i in segments])[:, None] + torch.arange(nk)
        q_idx, k_idx = q_idx.to(q.device), k_idx.to(q.device)
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        o = F.scaled_dot_product_attention(
            q[q_idx].transpose(1, 2),  # (segments, heads, nq, dim)
            k[k_idx].transpose(1, 2),
            v[k_idx].transpose(1, 2),
            attn_mask=mask,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        outs.append(o.transpose(1, 2).flatten(0, 1))
        order.append(q_idx.flatten())
    order = torch.cat(order)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat(outs)[inverse]


class FlashVarlen(torch.autograd.Function):
    """FlashAttention-2 varlen, causal, q (t, heads, dim) over k/v (t_k, groups, dim) with groups dividing heads
    (torch's `_flash_attention_forward` / `_flash_attention_backward`, the ops under `varlen_attn`): query rows
    bounded by `cu_seqlens` (none longer than `longest`), key rows by `cu_seqlens_k` (`longest_k`; default the
    query's). Where a row has fewer queries than keys the causal mask is aligned to its end
    (engine/models/shared_prompt_attention.py)."""

    @staticmethod
    def forward(
        ctx, q, k, v, cu_seqlens, longest: int, scale: float | None, cu_seqlens_k=None, longest_k=None
    ):
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
        longest_k = longest if longest_k is None else longest_k
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_k, longest, longest_k, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, cu_k, rng_state, unused)
        ctx.longest, ctx.longest_k, ctx.scale = longest, longest_k, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, cu_k, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu,
            cu_k,
            ctx.longest,
            ctx.longest_k,
            0.0,
            True,
            rng_state,
            unused,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None, None, None
