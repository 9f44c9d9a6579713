"""The naive weight transition every comparison is made against: each rank gathers the full model
(per-tensor TP all-gather, then a broadcast from the owning PP stage), as today's verl does before it
streams weights into vLLM. Rollout then runs at TP=1 on every rank; each rank of a training DP replica's
model-parallel group generates one share of that replica's prompts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.layout import PartitionKind
from parallel.rollout_weights import RolloutWeights, global_param_names, partition_kind
from parallel.state import ProcessGroups


def _gather_tp(shard: torch.Tensor, kind: PartitionKind, groups: ProcessGroups) -> torch.Tensor:
    t = groups.dims.tp
    if t == 1 or kind == PartitionKind.REPLICATED:
        return shard.detach().clone() if t == 1 else shard.detach()
    parts = [torch.empty_like(shard) for _ in range(t)]
    dist.all_gather(parts, shard.detach().contiguous(), group=groups.tp)
    if kind == PartitionKind.ROW:
        return torch.cat(parts, dim=1)
    if kind == PartitionKind.COLUMN_GATED:  # each shard is [gate_i; up_i]: regroup to [gate; up]
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=0)


class NaiveGather:
    """Train -> rollout by gathering every full tensor on every rank; rollout -> train drops the copy."""

    def __init__(
        self, chunks: list[torch.nn.Module], groups: ProcessGroups, num_layers: int, tie_embeddings: bool
    ):
        dims = groups.dims
        layout = dims.train_layout()
        self.groups = groups
        self.tie_embeddings = tie_embeddings
        self.local = global_param_names(chunks, layout.layers(groups.pp_rank, num_layers))
        meta = [(name, tuple(p.shape), p.dtype) for name, p in self.local.items()]
        per_stage: list[list] = [None] * dims.pp
        dist.all_gather_object(per_stage, meta, group=groups.pp)
        self.per_stage = per_stage  # stage -> [(name, local shard shape, dtype)]
        self._weights: RolloutWeights | None = None

    def to_rollout(self) -> RolloutWeights:
        groups, dims = self.groups, self.groups.dims
        params: dict[str, torch.Tensor] = {}
        for stage, meta in enumerate(self.per_stage):
            src = dist.get_global_rank(groups.pp, stage)
            for name, shape, dtype in meta:
                if name in params or (self.tie_embeddings and name == "output_layer.weight"):
                    continue
                kind = partition_kind(name)
                if stage == groups.pp_rank:
                    full = _gather_tp(self.local[name], kind, groups)
                else:
                    full = torch.empty(_full_shape(shape, kind, dims.tp), dtype=dtype, device=groups.device)
                if dims.pp > 1:
                    dist.broadcast(full, src=src, group=groups.pp)
                params[name] = full
        mp_size = dims.tp * dims.pp
        self._weights = RolloutWeights(
            params=params,
            tp_size=1,
            tp_rank=0,
            tp_group=None,
            micro_dp_group=groups.mp if mp_size > 1 else None,
            micro_dp_rank=dist.get_rank(groups.mp),
            micro_dp_size=mp_size,
        )
        return self._weights

    def to_train(self) -> None:
        self._weights = None  # training shards were never touched; drop the gathered copy


def _full_shape(shard_shape: tuple, kind: PartitionKind, tp: int) -> tuple:
    if kind == PartitionKind.REPLICATED or tp == 1:
        return shard_shape
    if kind == PartitionKind.ROW:
        return (shard_shape[0], shard_shape[1] * tp, *shard_shape[2:])
    return (shard_shape[0] * tp, *shard_shape[1:])
