"""Checks of a weight transition against the full weights, and a CPU allocation counter; used by the
3D-HybridEngine tests and `scripts/bench/reshard.py`. Nothing here runs in a training job.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel.hybrid_layout import HybridLayout, ParamSpec
from parallel.layout import PartitionKind
from parallel.rollout_weights import RolloutWeights, partition_kind, split_layer_name


def megatron_shard(full: torch.Tensor, kind: PartitionKind, tp: int, tp_rank: int) -> torch.Tensor:
    """Megatron's TP shard `tp_rank` of a full tensor (the full fc1 is [gate; up], a shard [gate_j; up_j])."""
    if kind == PartitionKind.REPLICATED or tp == 1:
        return full
    if kind == PartitionKind.ROW:
        return full.chunk(tp, dim=1)[tp_rank]
    if kind == PartitionKind.COLUMN_GATED:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])
    return full.chunk(tp, dim=0)[tp_rank]


def expected_rollout_names(
    layout: HybridLayout, rank: int, full_names: list[str], num_layers: int, tie_embeddings: bool
) -> set[str]:
    """Names of the rollout shard of `rank`: its stage's layers, the embedding on the first stage (and on the
    last when tied), the final norm and the untied output layer on the last stage."""
    coords = layout.rollout_coords(rank)
    first, last = coords.pp_rank == 0, coords.pp_rank == layout.rollout.pp - 1
    layers = {i for r in layout.rollout_layers(rank, num_layers) for i in r}
    names = set()
    for name in full_names:
        parts = split_layer_name(name)
        if parts is not None:
            keep = parts[0] in layers
        elif name == "embedding.word_embeddings.weight":
            keep = first or (last and tie_embeddings)
        else:
            keep = last
        if keep:
            names.add(name)
    return names


def verify_rollout(
    weights: RolloutWeights,
    full: dict[str, torch.Tensor],
    layout: HybridLayout,
    rank: int,
    num_layers: int,
    tie_embeddings: bool,
) -> list[str]:
    """Every mismatch between `weights` and the slices of the full weights (empty list = exact match)."""
    errors = []
    expected = expected_rollout_names(layout, rank, list(full), num_layers, tie_embeddings)
    if set(weights.params) != expected:
        errors.append(
            f"names differ: missing {sorted(expected - set(weights.params))}, "
            f"extra {sorted(set(weights.params) - expected)}"
        )
    for name in sorted(expected & set(weights.params)):
        want = megatron_shard(full[name], partition_kind(name), weights.tp_size, weights.tp_rank)
        got = weights.params[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            errors.append(
                f"{name}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
            )
        elif not torch.equal(got, want.to(got.device)):
            errors.append(f"{name}: values differ (max abs {float((got - want).abs().max()):.3g})")
    return errors


def layer_param_specs(
    full: dict[str, torch.Tensor], layout: HybridLayout, num_layers: int
) -> list[ParamSpec]:
    """`ParamSpec`s of the layer parameters of the full model, for `HybridLayout.received_bytes`."""
    specs = []
    for name, tensor in full.items():
        parts = split_layer_name(name)
        if parts is not None:
            stage = layout.train.stage_of_layer(parts[0], num_layers)
            specs.append(ParamSpec(tensor.numel() * tensor.element_size(), partition_kind(name), stage))
    return specs


def hybridflow_bytes(layout: HybridLayout, model_bytes: int) -> float:
    """HybridFlow's per-rank communication (t*p - t_g*p_g) / (t_g*p_g*t*p) * M."""
    t, p = layout.train.tp, layout.train.pp
    tg, pg = layout.rollout.tp, layout.rollout.pp
    return (t * p - tg * pg) / (tg * pg * t * p) * model_bytes


class AllocationCounter(TorchDispatchMode):
    """Sums the bytes of every new storage created by torch ops inside the context (views, in-place ops and
    collectives writing into given tensors allocate nothing). A CPU stand-in for CUDA's memory statistics."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.layout == torch.strided
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs and storage.nbytes() > 0:
                    inputs.add(storage.data_ptr())
                    self.bytes += storage.nbytes()
                    self.count += 1
        return out


def full_from_shards(shards: list[torch.Tensor], kind: PartitionKind) -> torch.Tensor:
    """The full tensor from megatron's TP shards in TP-rank order (the inverse of `megatron_shard`)."""
    if kind == PartitionKind.REPLICATED or len(shards) == 1:
        return shards[0]
    if kind == PartitionKind.ROW:
        return torch.cat(shards, dim=1)
    if kind == PartitionKind.COLUMN_GATED:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)


def verify_split_transfer(transfer, group) -> list[str]:
    """Split placement (`parallel/split_transfer.py`, after a `send`/`receive`): every rollout rank's shard
    against the slices of the full weights, rebuilt tensor by tensor from the training shards sent whole with
    plain send/recv (a path independent of the transfer's plan). Collective over `group`, all ranks; returns
    this rank's mismatches (empty = bit-exact). Memory: one full tensor at a time."""
    import torch.distributed as dist

    layout, rank = transfer.layout, transfer.rank
    train = layout.train
    errors = []
    for dst in range(layout.rollout_start, layout.world_size):
        j, e = layout.rollout_coords(dst)
        replica = layout.source_replica(e)
        for name, meta in transfer.tensors.items():
            sources = [train.rank(a, meta.stage, replica) for a in range(train.tp)]
            if rank in sources:
                dist.send(transfer.local[name].detach().contiguous(), dst, group=group)
            if rank != dst:
                continue
            shards = []
            for src in sources:
                shard = torch.empty(
                    meta.shard_shape(train.tp), dtype=transfer.dtypes[name], device=transfer.device
                )
                dist.recv(shard, src, group=group)
                shards.append(shard)
            want = megatron_shard(full_from_shards(shards, meta.kind), meta.kind, layout.rollout_tp, j)
            got = transfer.params[name]
            if got.shape != want.shape or not torch.equal(got, want):
                errors.append(f"rank {dst} {name}: differs from the full weights' rollout slice")
    return errors


def gather_full_experts(
    chunks: list[torch.nn.Module], groups, num_layers: int, num_experts: int
) -> dict[str, torch.Tensor]:
    """Every routed expert of the model by global name, collected from every rank's training weights with
    `all_gather_object` (an independent reference for the expert transition; small models only)."""
    import torch.distributed as dist

    from parallel.rollout_weights import global_param_names, is_expert_param

    layers = groups.dims.train_layout().layers(groups.pp_rank, num_layers)
    local = global_param_names(chunks, layers, groups.expert_offset(num_experts))
    mine = {n: p.detach().cpu().clone() for n, p in local.items() if is_expert_param(n)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full: dict[str, torch.Tensor] = {}
    for experts in everyone:
        for name, tensor in experts.items():
            if name in full and not torch.equal(full[name], tensor):
                raise AssertionError(f"{name}: the expert-data-parallel replicas differ")
            full[name] = tensor
    return full
