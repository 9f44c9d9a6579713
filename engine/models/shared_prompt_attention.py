"""Attention and RoPE positions for micro-batches that hold each group's prompt once (trainer.share_prompts;
the layout: engine/roles/shared_prompts.py).

A micro-batch of this layout lies as segments back to back: every unit's prompt, then each unit's responses
in the same order, and last any padding (a pseudo-row of its own). A prompt segment attends causally to
itself; a response segment's query i attends to its prompt and to its own first i + 1 tokens: the keys of
each response segment are its prompt's followed by its own, gathered by `kv_index`
(`GatherRows`, whose backward sums the responses' key/value gradients into the prompt's in float32), and the
causal mask is aligned to the end of the keys. Exactly the attention each row has when it lies alone with its
prompt: the prompt's tokens attend only to the prompt, so they compute the same in every row of the group.
On CUDA in half precision without dropout the first of these that applies runs (a split at each response's
prompt, no keys gathered: engine/models/shared_prompt_split.py, only where its kernel passed its check on
this device):
- every unit of one shape (`uniform`; a fixed-length step), once the shape recurs (`RecurringShapes`: cuDNN
  builds a plan per shape), unless torch's deterministic algorithms are on (cuDNN's attention backward is
  not one): split, the prompts and the responses as dense batches through cuDNN;
- with `SPLIT_VARLEN` (off) where `cross` is given (every unit with responses has a prompt): split through
  FlashAttention-2 varlen, all segments over themselves and the responses over their prompts;
- else the gathered keys: FlashAttention-2 varlen with separate query and key boundaries (its causal mask is
  aligned to the bottom right where queries are fewer than keys, FlashAttention >= 2.1's rule).
- Elsewhere: SDPA with that mask spelled out, the segments of one shape in one batched call
  (engine/models/packed_attention.py `segment_attention`; one host sync for the lengths).

RoPE: a response's tokens sit at positions P..P+R-1 after a prompt of P, which megatron's thd RoPE (positions
restart at every `cu_seqlens` boundary) cannot express; `SHARED_POSITIONS` holds each micro-batch's positions
for its `cu_seqlens` tensor, which megatron hands to the RoPE hook (engine/models/spec.py `fused_rope_thd`),
and the attention refuses a micro-batch whose positions that hook did not take (megatron's unfused RoPE,
`Fusions(rope=False)`, would rotate responses from position 0).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from engine.models.lse_kernels import CUDNN, FLASH_VARLEN
from engine.models.packed_attention import RECURRING, FlashVarlen, flash_applies, segment_attention
from engine.models.shared_prompt_split import (
    CrossSegments,
    split_attention,
    split_available,
    varlen_split_attention,
)


@dataclass
class SharedPromptSeqParams(PackedSeqParams):
    """megatron's thd `PackedSeqParams` (`cu_seqlens_q` = `cu_seqlens_kv`: the segments, which RoPE receives;
    `max_seqlen_q` = `max_seqlen_kv`: the longest row, prompt + response, for megatron's RoPE table) and the
    keys of each segment: `kv_index` (t_k,) token positions, bounded by `cu_seqlens_k`; `max_q`, `max_k` the
    longest query and key segments; `uniform` (units, responses per unit, prompt length, response length)
    where every unit has that shape and nothing pads the micro-batch (engine/roles/shared_prompts.py
    `uniform_shape`), else None; `cross` the responses' segments over their prompts' keys for the split
    attention (engine/models/shared_prompt_split.py), None where it cannot run."""

    kv_index: torch.Tensor = None
    cu_seqlens_k: torch.Tensor = None
    max_q: int = 0
    max_k: int = 0
    uniform: tuple[int, int, int, int] | None = None
    cross: CrossSegments | None = None


class SharedPositions:
    """Each live shared-prompt micro-batch's token positions, by its `cu_seqlens` tensor (held by id, dropped
    when the tensor is freed); `take` returns them to the RoPE hook and marks them taken."""

    def __init__(self):
        self.entries: dict[int, list] = {}

    def register(self, cu_seqlens: torch.Tensor, positions: torch.Tensor) -> None:
        key = id(cu_seqlens)
        self.entries[key] = [positions, False]
        weakref.finalize(cu_seqlens, self.entries.pop, key, None)

    def take(self, cu_seqlens: torch.Tensor) -> torch.Tensor | None:
        entry = self.entries.get(id(cu_seqlens))
        if entry is None:
            return None
        entry[1] = True
        return entry[0]

    def taken(self, cu_seqlens: torch.Tensor) -> bool:
        entry = self.entries.get(id(cu_seqlens))
        return entry is not None and entry[1]


SHARED_POSITIONS = SharedPositions()

SPLIT_VARLEN = False
"""The split through FlashAttention-2 varlen where a micro-batch has no single shape: off until measured
against the gathered keys on a GPU. It saves the keys' gathers and float32 scatter-adds but adds passes over
the responses' queries and outputs, six times the keys' size at Qwen2.5's 12 heads in 2 groups (the cross
part's query reads and output writes, the merge, the query-gradient add); `scripts/bench/shared_attention.py`
(`split_flash` against `gathered`) and `update.py --varlen-split` measure it."""


class SharedCalls:
    """This process's shared-prompt attention calls by path: "cudnn" and "flash" (split at the prompt,
    engine/models/shared_prompt_split.py), "gathered" (keys gathered behind their prompt's); the step's
    statistics read them (engine/step/stats.py)."""

    PATHS = ("cudnn", "flash", "gathered")

    def __init__(self):
        self.calls = dict.fromkeys(self.PATHS, 0)

    def count(self, path: str) -> None:
        self.calls[path] += 1

    def since_last(self) -> tuple[int, ...]:
        """Calls per path (`PATHS` order) since the last read."""
        counts = tuple(self.calls.values())
        self.calls = dict.fromkeys(self.PATHS, 0)
        return counts


SHARED_CALLS = SharedCalls()


def shared_prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: SharedPromptSeqParams,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """q (t, heads, dim), k/v (t, groups, dim) of a shared-prompt micro-batch -> (t, heads, dim) (module
    docstring)."""
    if not SHARED_POSITIONS.taken(params.cu_seqlens_q):
        raise RuntimeError(
            "trainer.share_prompts: the micro-batch's RoPE positions were not applied (the fused RoPE hook of "
            "engine/models/spec.py did not run): a response would be rotated from position 0"
        )
    if flash_applies(q, dropout_p):
        if params.uniform is not None and not torch.are_deterministic_algorithms_enabled():
            shape = ("shared", *params.uniform, *q.shape[1:], k.shape[1], q.dtype, torch.is_grad_enabled())
            if RECURRING(shape) and split_available(q, k, v, CUDNN):
                SHARED_CALLS.count("cudnn")
                return split_attention(q, k, v, params.uniform, scale, CUDNN)
        if SPLIT_VARLEN and params.cross is not None and split_available(q, k, v, FLASH_VARLEN):
            SHARED_CALLS.count("flash")
            cu, longest = params.cu_seqlens_q, params.max_q
            return varlen_split_attention(q, k, v, cu, longest, params.cross, scale, FLASH_VARLEN)
    SHARED_CALLS.count("gathered")
    k_seg, v_seg = GatherRows.apply(k, params.kv_index), GatherRows.apply(v, params.kv_index)
    if flash_applies(q, dropout_p):
        check_flash_alignment(q.device, q.dtype)
        cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_k
        return FlashVarlen.apply(q, k_seg, v_seg, cu_q, params.max_q, scale, cu_k, params.max_k)
    return segment_attention(q, k_seg, v_seg, params.cu_seqlens_q, params.cu_seqlens_k, scale, dropout_p)


class GatherRows(torch.autograd.Function):
    """x[index] along the first dimension, whose backward sums each row's gradients (a prompt's keys and values
    gathered in front of every response of its group) in float32 and rounds once. Autograd's own backward
    for indexing adds the repeated rows one at a time in x's dtype (a read, add and bfloat16 store per copy,
    on the CPU and in CUDA's sorted `indexing_backward_kernel` alike): at bfloat16 with 9 copies 2.3x the
    mean error of one rounding (tests/engine/test_shared_prompts.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        total = grad.new_zeros((ctx.rows, *grad.shape[1:]), dtype=torch.float32)
        total.index_put_((index,), grad.float(), accumulate=True)  # sorted on CUDA: deterministic
        return total.to(grad.dtype), None


_ALIGNMENT_CHECKED: set[tuple] = set()


def check_flash_alignment(device: torch.device, dtype: torch.dtype) -> None:
    """Once per device and dtype: FlashAttention-2's causal mask where a row has fewer queries than keys must be
    aligned to the keys' end (FlashAttention >= 2.1; version 2.0 aligned it to their start, which would let a
    response attend to neither its prompt's end nor itself). A two-row case against `segment_attention`;
    raises instead of training on the wrong attention."""
    if (device, dtype) in _ALIGNMENT_CHECKED:
        return
    gen = torch.Generator(device=device).manual_seed(0)
    q_lens, k_lens = [3, 2], [5, 2]  # a response of 3 after a prompt of 2; a row of 2 alone
    q = torch.randn(sum(q_lens), 2, 64, device=device, generator=gen).to(dtype)
    k, v = (torch.randn(sum(k_lens), 1, 64, device=device, generator=gen).to(dtype) for _ in range(2))
    cu_q = torch.tensor([0, 3, 5], device=device, dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7], device=device, dtype=torch.int32)
    with torch.no_grad():
        got = FlashVarlen.apply(q, k, v, cu_q, 3, None, cu_k, 5)
        want = segment_attention(q.float(), k.float(), v.float(), cu_q, cu_k, None, 0.0)
    if (got.float() - want).abs().max() > 0.05:
        raise RuntimeError(
            "trainer.share_prompts: this torch's FlashAttention-2 does not align its causal mask to the keys' end "
            "where a row has fewer queries than keys; set trainer.share_prompts=false"
        )
    _ALIGNMENT_CHECKED.add((device, dtype))
