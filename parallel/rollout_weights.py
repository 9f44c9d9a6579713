"""What a rollout engine receives from a weight transition: this rank's rollout-layout shards of the actor,
named with global layer indices, plus the groups the rollout runs on.

Names follow megatron's GPTModel with the chunk-local layer index replaced by the global one, e.g.
`decoder.layers.17.mlp.linear_fc1.weight`. Shards follow megatron's TP rules at the rollout TP size:
column-parallel tensors split along dim 0 (QKV interleaved per query group, vocab rows of the embedding and
output layer), row-parallel along dim 1, `linear_fc1` as [gate_j; up_j]. `output_layer.weight` is absent when
embeddings are tied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from parallel.layout import PartitionKind

_KIND_BY_SUFFIX = (
    ("mlp.router.weight", PartitionKind.REPLICATED),
    ("mlp.shared_experts.gate_weight", PartitionKind.REPLICATED),
    ("mlp.shared_experts.linear_fc1.weight", PartitionKind.COLUMN_GATED),
    ("mlp.shared_experts.linear_fc2.weight", PartitionKind.ROW),
    ("self_attention.linear_qkv.weight", PartitionKind.COLUMN),
    ("self_attention.linear_qkv.bias", PartitionKind.COLUMN),
    ("self_attention.linear_proj.weight", PartitionKind.ROW),
    ("mlp.linear_fc1.weight", PartitionKind.COLUMN_GATED),
    ("mlp.linear_fc2.weight", PartitionKind.ROW),
    ("embedding.word_embeddings.weight", PartitionKind.COLUMN),
    ("output_layer.weight", PartitionKind.COLUMN),
)
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def is_expert_param(name: str) -> bool:
    """Whether `name` is a routed expert's weight (split over expert-parallel ranks by expert, whole on each)."""
    return _EXPERT_RE.match(name) is not None


def partition_kind(name: str) -> PartitionKind:
    """How megatron splits parameter `name` over TP ranks (norms, QK-norms, routers and routed experts are
    replicated: expert TP is 1)."""
    if is_expert_param(name):
        return PartitionKind.REPLICATED
    for suffix, kind in _KIND_BY_SUFFIX:
        if name.endswith(suffix):
            return kind
    if name.endswith("layernorm.weight") or name.endswith("layernorm.bias"):
        return PartitionKind.REPLICATED
    raise ValueError(f"no TP partition rule for parameter {name!r}; add it to parallel/rollout_weights.py")


def split_layer_name(name: str) -> tuple[int, str] | None:
    """`decoder.layers.3.mlp.x` -> (3, 'mlp.x'); None for non-layer parameters."""
    match = _LAYER_RE.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def global_param_names(
    chunks: list[torch.nn.Module], layer_ranges: list[range], expert_offset: int = 0
) -> dict[str, torch.nn.Parameter]:
    """This rank's training parameters keyed by global name (chunk-local layer ids mapped through
    `layer_ranges`, one range per virtual chunk; local expert i of an MoE layer named as expert
    `expert_offset + i`, the offset being ep_rank * local experts). Unwraps megatron's DDP/Float16 wrappers."""
    out: dict[str, torch.nn.Parameter] = {}
    for chunk, layers in zip(chunks, layer_ranges):
        for name, param in chunk.named_parameters():
            name = name.removeprefix("module.").removeprefix("module.")
            parts = split_layer_name(name)
            if parts is not None:
                name = f"decoder.layers.{layers[parts[0]]}.{parts[1]}"
            expert = _EXPERT_RE.match(name)
            if expert is not None and expert_offset:
                name = f"{expert.group(1)}{int(expert.group(2)) + expert_offset}{expert.group(3)}"
            out[name] = param
    return out


@dataclass
class RolloutWeights:
    """This rank's actor weights in the rollout layout, and the rollout groups."""

    params: dict[str, torch.Tensor]
    """Global name -> rollout-TP shard (see module docstring)."""
    tp_size: int
    """Rollout TP size."""
    tp_rank: int
    """This rank's index in its rollout TP group."""
    tp_group: dist.ProcessGroup | None
    """Rollout TP group (None when tp_size == 1)."""
    micro_dp_group: dist.ProcessGroup | None
    """Ranks of one training DP replica that split its prompts for rollout (None when of size 1)."""
    micro_dp_rank: int
    """This rank's position in the micro-DP group: which share of the prompts it generates."""
    micro_dp_size: int
    """Number of prompt shares per training DP replica."""
    pp_size: int = 1
    """Rollout PP size (`rollout.pp`); `params` holds only this stage's layers when > 1."""
    pp_rank: int = 0
    """This rank's rollout stage."""
    pp_group: dist.ProcessGroup | None = None
    """Rollout PP group (None when pp_size == 1)."""


class WeightSync(Protocol):
    """The train -> rollout weight transition: `HybridEngine` (in place, parallel/hybrid_engine.py) or
    `NaiveGather` (every rank gathers the full model, the benchmark baseline)."""

    def to_rollout(self) -> RolloutWeights:
        """The actor's weights in the rollout layout (collective)."""
        ...

    def to_train(self) -> None:
        """Release what `to_rollout` built; the training layout is intact afterwards (collective)."""
        ...
