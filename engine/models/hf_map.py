"""The one table from Megatron GPTModel parameter names to Hugging Face tensor names, and the TP split rules.

Every piece of code that moves weights between the two worlds (HF load/save, the 3D-HybridEngine reshard,
a vLLM weight loader) reads `WEIGHT_MAP` and the three functions below instead of re-deriving layouts:

- `shard_from_hf(rule, read, out, ...)`: fill one TP shard of a Megatron parameter from HF tensors,
  reading only the slices it needs (`read` slices e.g. a memory-mapped safetensors view);
- `hf_pieces_of_shard(rule, shard, ...)`: cut one Megatron TP shard into its HF-named pieces (the q/k/v or
  gate/up parts of this rank), which is what a vLLM loader with per-shard `weight_loader`s wants;
- `hf_from_shards(rule, shards, ...)`: the full HF tensors from all TP shards (export).

Megatron layouts (per TP rank r of T): the fused QKV holds, for each of this rank's query groups
g in [r*G/T, (r+1)*G/T), [q heads of g; k of g; v of g]; the SwiGLU fc1 holds [gate_r; up_r]
(concatenating shards does NOT give the unsharded fc1); embeddings/output layer rows are split over
the vocabulary padded to a multiple of T (padded rows are zero and never exported).
Mixture of experts (Qwen3-MoE / Qwen2-MoE): the router is `mlp.gate`, replicated; routed expert e of a layer is
`local_experts.{expert}` in Megatron (the local index on its expert-parallel rank; `hf_names` takes the
global one) and `mlp.experts.{e}.gate_proj/up_proj/down_proj` in HF, whole on every TP rank (expert TP is 1:
use tp=1, rank 0 for `WeightRule.expert` rules); Qwen2-MoE's shared expert is split over TP like a dense MLP.
Pure tensor code: no I/O, no torch.distributed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from engine.models.builder import ModelShape


class Split(str, Enum):
    """How a Megatron parameter is split over the TP ranks, and how it maps onto its HF tensors."""

    REPLICATED = "replicated"
    """Whole on every TP rank (norms, QK-norm weights, the value head)."""
    ROW = "row"
    """RowParallelLinear: input dim (dim 1) split in T equal parts."""
    VOCAB = "vocab"
    """Vocabulary rows (dim 0) split over the padded vocabulary."""
    QKV = "qkv"
    """Fused [q; k; v] per query group; query groups split over TP. HF: q_proj, k_proj, v_proj."""
    GATE_UP = "gate_up"
    """SwiGLU fc1 = [gate_r; up_r] on rank r. HF: gate_proj, up_proj."""


@dataclass(frozen=True)
class WeightRule:
    """One Megatron parameter name pattern and the HF tensors it is made of."""

    megatron: str
    """Name inside a model chunk; `{layer}` stands for the chunk-local layer index."""
    hf: tuple[str, ...]
    """HF tensor names; `{layer}` stands for the global (0-based) layer index."""
    split: Split
    """TP split rule."""
    expert: bool = False
    """A routed expert's weight: `{expert}` in both names; whole on each TP rank (split it with tp=1)."""


_L = "model.layers.{layer}."
_M = "decoder.layers.{layer}."
WEIGHT_MAP: tuple[WeightRule, ...] = (
    WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB),
    WeightRule(_M + "input_layernorm.weight", (_L + "input_layernorm.weight",), Split.REPLICATED),
    WeightRule(
        _M + "self_attention.linear_qkv.weight",
        tuple(_L + f"self_attn.{p}_proj.weight" for p in "qkv"),
        Split.QKV,
    ),
    WeightRule(
        _M + "self_attention.linear_qkv.bias",
        tuple(_L + f"self_attn.{p}_proj.bias" for p in "qkv"),
        Split.QKV,
    ),
    WeightRule(_M + "self_attention.q_layernorm.weight", (_L + "self_attn.q_norm.weight",), Split.REPLICATED),
    WeightRule(_M + "self_attention.k_layernorm.weight", (_L + "self_attn.k_norm.weight",), Split.REPLICATED),
    WeightRule(_M + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), Split.ROW),
    WeightRule(_M + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",), Split.REPLICATED),
    WeightRule(
        _M + "mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), Split.GATE_UP
    ),
    WeightRule(_M + "mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), Split.ROW),
    WeightRule(_M + "mlp.router.weight", (_L + "mlp.gate.weight",), Split.REPLICATED),
    WeightRule(
        _M + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
        (_L + "mlp.experts.{expert}.gate_proj.weight", _L + "mlp.experts.{expert}.up_proj.weight"),
        Split.GATE_UP,
        expert=True,
    ),
    WeightRule(
        _M + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
        (_L + "mlp.experts.{expert}.down_proj.weight",),
        Split.ROW,
        expert=True,
    ),
    WeightRule(
        _M + "mlp.shared_experts.linear_fc1.weight",
        (_L + "mlp.shared_expert.gate_proj.weight", _L + "mlp.shared_expert.up_proj.weight"),
        Split.GATE_UP,
    ),
    WeightRule(
        _M + "mlp.shared_experts.linear_fc2.weight", (_L + "mlp.shared_expert.down_proj.weight",), Split.ROW
    ),
    WeightRule(
        _M + "mlp.shared_experts.gate_weight", (_L + "mlp.shared_expert_gate.weight",), Split.REPLICATED
    ),
    WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED),
    WeightRule("output_layer.weight", ("lm_head.weight",), Split.VOCAB),
)
TIED_OUTPUT_RULE = WeightRule("output_layer.weight", ("model.embed_tokens.weight",), Split.VOCAB)
"""The last stage's output layer when embeddings are tied (megatron keeps a synchronised copy at PP > 1)."""
VALUE_HEAD_RULE = WeightRule("output_layer.weight", ("score.weight",), Split.REPLICATED)
"""The critic's `ValueHead` (1, hidden) <-> HF *ForTokenClassification `score.weight` (optional on load)."""
VALUE_HEAD_BIAS = "score.bias"
"""HF *ForTokenClassification heads have a bias the engine's ValueHead lacks: loaded only if zero, saved as zero."""

_PATTERNS = [
    (
        re.compile(
            "^"
            + re.escape(r.megatron)
            .replace(r"\{layer\}", r"(?P<layer>\d+)")
            .replace(r"\{expert\}", r"(?P<expert>\d+)")
            + "$"
        ),
        r,
    )
    for r in WEIGHT_MAP
]


def match_rule(name: str) -> tuple[WeightRule, int | None]:
    """The rule for Megatron parameter `name` and its chunk-local layer index (None outside layers)."""
    for pattern, rule in _PATTERNS:
        m = pattern.match(name)
        if m:
            return rule, int(m.group("layer")) if "layer" in pattern.groupindex else None
    raise KeyError(f"no HF mapping for Megatron parameter {name!r}; add a WeightRule to WEIGHT_MAP")


def local_expert(name: str) -> int:
    """The expert index in Megatron parameter `name` of an expert rule (local to its expert-parallel rank)."""
    for pattern, rule in _PATTERNS:
        m = pattern.match(name)
        if m and rule.expert:
            return int(m.group("expert"))
    raise KeyError(f"{name!r} is not a routed expert's parameter")


def hf_names(rule: WeightRule, layer: int | None, expert: int | None = None) -> tuple[str, ...]:
    """The HF tensor names of `rule` for global layer `layer` (and global expert `expert` of expert rules)."""
    return tuple(n.format(layer=layer, expert=expert) for n in rule.hf)


def _qkv_rows(shape: ModelShape) -> tuple[int, int]:
    """(q rows, k/v rows) per query group."""
    heads_per_group = shape.num_attention_heads // shape.num_query_groups
    return heads_per_group * shape.head_dim, shape.head_dim


Read = Callable[[int, tuple[slice, ...]], torch.Tensor]
"""read(i, index): HF tensor number i of the rule, sliced by `index` (a tuple of slices)."""


def _rows(start: int, stop: int) -> tuple[slice, ...]:
    return (slice(start, stop),)


def shard_from_hf(
    rule: WeightRule, read: Read, out: torch.Tensor, shape: ModelShape, tp: int, rank: int
) -> None:
    """Fill `out` with TP shard `rank` of `tp` of the Megatron parameter, from its HF tensors.

    Reads only the rows/columns this rank holds and copies them straight into `out` (no temporaries:
    with memory-mapped views nothing but `out` is ever allocated); vocabulary padding rows become zeros.
    """
    if rule.split is Split.REPLICATED:
        out.copy_(read(0, ()))
    elif rule.split is Split.ROW:
        n = out.shape[1]
        out.copy_(read(0, (slice(None), slice(rank * n, (rank + 1) * n))))
    elif rule.split is Split.VOCAB:
        n = out.shape[0]
        start, stop = rank * n, min((rank + 1) * n, shape.vocab_size)
        real = max(stop - start, 0)
        if real:
            out[:real].copy_(read(0, _rows(start, stop)))
        out[real:].zero_()
    elif rule.split is Split.GATE_UP:
        n = out.shape[0] // 2
        for i in (0, 1):  # [gate_r; up_r]
            out[i * n : (i + 1) * n].copy_(read(i, _rows(rank * n, (rank + 1) * n)))
    elif rule.split is Split.QKV:
        groups = shape.num_query_groups // tp
        q_rows, kv_rows = _qkv_rows(shape)
        grouped = out.view(groups, q_rows + 2 * kv_rows, *out.shape[1:])  # [q_g; k_g; v_g] per group
        begin = 0
        for i, rows in enumerate((q_rows, kv_rows, kv_rows)):
            part = read(i, _rows(rank * groups * rows, (rank + 1) * groups * rows))
            grouped[:, begin : begin + rows].copy_(part.view(groups, rows, *part.shape[1:]))
            begin += rows
    else:
        raise ValueError(f"unknown split {rule.split}")


def hf_pieces_of_shard(
    rule: WeightRule, shard: torch.Tensor, shape: ModelShape, tp: int
) -> tuple[torch.Tensor, ...]:
    """Cut one Megatron TP shard into this rank's parts of the HF tensors (same order as `rule.hf`).

    VOCAB shards keep their padding rows (the caller knows which rank holds the real vocabulary end).
    """
    if rule.split is Split.GATE_UP:
        return tuple(shard.chunk(2, dim=0))
    if rule.split is Split.QKV:
        q_rows, kv_rows = _qkv_rows(shape)
        grouped = shard.reshape(shape.num_query_groups // tp, q_rows + 2 * kv_rows, *shard.shape[1:])
        q, k, v = grouped.split([q_rows, kv_rows, kv_rows], dim=1)
        return tuple(p.reshape(-1, *shard.shape[1:]) for p in (q, k, v))
    return (shard,)


def hf_from_shards(
    rule: WeightRule, shards: list[torch.Tensor], shape: ModelShape
) -> tuple[torch.Tensor, ...]:
    """The full HF tensors of `rule` from the Megatron shards of all TP ranks (in TP rank order)."""
    if rule.split is Split.REPLICATED:
        return (shards[0],)
    tp = len(shards)
    pieces = [hf_pieces_of_shard(rule, s, shape, tp) for s in shards]
    dim = 1 if rule.split is Split.ROW else 0
    full = tuple(torch.cat([p[i] for p in pieces], dim=dim) for i in range(len(rule.hf)))
    if rule.split is Split.VOCAB:
        full = tuple(t[: shape.vocab_size] for t in full)
    return full
