"""The 3D-HybridEngine's expert part: routed experts regrouped from the training layout (expert parallel EP,
pipeline stages PP; expert TP is 1, so an expert is whole on every rank that holds it) into the rollout
layout, where each rank runs every expert of the layers it holds (rollout EP is 1, every rollout-TP rank
holds the experts whole).

`ExpertGather` wraps the dense transition (`HybridEngine` built with `skip_experts=True`, or `NaiveGather`):
the inner sync regroups the dense weights inside the micro-DP groups (TP shards, PP stages; no full-model
gather), and this class moves the experts by point-to-point messages over the world:
- at construction every rank publishes the names, shapes and dtypes of its local experts (global layer and
  expert indices) and the layers it holds in the rollout; every rank derives the same plan from that. The
  holders of an expert are the ranks of one training stage with one expert-parallel rank (its expert
  data-parallel replicas); a rank that needs a block of experts it does not hold receives it from one
  holder, the receivers of a block spread round-robin over its holders;
- `to_rollout` runs one batched exchange (`dist.batch_isend_irecv`, one op per expert tensor: senders send
  their training parameters as they are, no packing copy) into ONE receive buffer; the rollout's expert
  tensors are views of it and of the rank's own training experts;
- `to_train` drops the receive buffer (or keeps it and refills it in place with `keep_rollout_weights`).

Memory per rank: the rollout holds E_g = E / p_g of the expert bytes E (p_g = rollout PP size, every
expert of its stage's layers); E / (ep * p) of it are views of the own training experts, the rest,
E / p_g - E / (ep * p) when the rank's training stage lies in its rollout stage, is the receive buffer and
also what the rank receives. Nothing of the own experts is copied.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist

from parallel.rollout_weights import RolloutWeights, WeightSync, global_param_names, is_expert_param
from parallel.state import ProcessGroups

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class ExpertMessage:
    """Expert tensors `names` (one order on both sides) that rank `src` sends to rank `dst`."""

    src: int
    dst: int
    names: tuple[str, ...]


def _layer_of(name: str) -> int:
    return int(_LAYER.match(name).group(1))


def plan_expert_messages(
    held: list[dict[str, tuple]], needed_layers: list[frozenset[int]]
) -> list[ExpertMessage]:
    """Every message of the expert exchange (pure; the same list on every rank).

    `held[r]` maps rank r's expert names (global indices) to their (shape, dtype); `needed_layers[r]` are the
    layers rank r holds in the rollout. A rank receives exactly the experts of its layers it does not hold,
    each once; the ranks holding the same set of experts (a block) share the sending round-robin.
    """
    holders: dict[str, list[int]] = {}
    for rank, names in enumerate(held):
        for name in names:
            holders.setdefault(name, []).append(rank)
    blocks: dict[tuple[int, ...], list[str]] = {}
    for name in sorted(holders):
        blocks.setdefault(tuple(holders[name]), []).append(name)
    pairs: dict[tuple[int, int], list[str]] = {}
    for block_holders, names in sorted(blocks.items()):
        receivers = [
            r
            for r in range(len(held))
            if r not in block_holders and any(_layer_of(n) in needed_layers[r] for n in names)
        ]
        for i, dst in enumerate(receivers):
            src = block_holders[i % len(block_holders)]
            wanted = [n for n in names if _layer_of(n) in needed_layers[dst]]
            pairs.setdefault((src, dst), []).extend(wanted)
    return [ExpertMessage(src, dst, tuple(names)) for (src, dst), names in sorted(pairs.items())]


class ExpertGather:
    """A `WeightSync` whose rollout weights hold every routed expert of the rollout's layers (see module
    docstring). `inner` must hand over no expert of its own (`HybridEngine(skip_experts=True)`; any experts it
    does hand over are dropped). `rollout_layers` are the layers this rank holds in the rollout (all layers
    unless rollout.pp > 1). Collective: construct on every rank in the same order."""

    def __init__(
        self,
        inner: WeightSync,
        chunks: list[torch.nn.Module],
        groups: ProcessGroups,
        num_layers: int,
        num_experts: int,
        rollout_layers: list[range],
        keep_rollout_weights: bool = False,
    ):
        if groups.experts is None:
            raise ValueError("ExpertGather needs the expert-parallel groups (ProcessGroups.experts)")
        self.inner, self.rank, self.keep = inner, groups.rank, keep_rollout_weights
        layers = groups.dims.train_layout().layers(groups.pp_rank, num_layers)
        named = global_param_names(chunks, layers, groups.expert_offset(num_experts))
        self.local = {n: p for n, p in named.items() if is_expert_param(n)}
        needed = frozenset(i for r in rollout_layers for i in r)
        mine = ({n: (tuple(p.shape), p.dtype) for n, p in self.local.items()}, needed)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        held, self.needed_layers = [e[0] for e in everyone], [e[1] for e in everyone]
        self.messages = plan_expert_messages(held, self.needed_layers)
        self.incoming = [m for m in self.messages if m.dst == self.rank]
        self.outgoing = [m for m in self.messages if m.src == self.rank]
        self._slots: dict[str, tuple[int, tuple, torch.dtype]] = {}  # name -> (byte offset, shape, dtype)
        offset = 0
        for msg in self.incoming:
            for name in msg.names:
                shape, dtype = held[msg.src][name]
                offset = -(-offset // dtype.itemsize) * dtype.itemsize
                self._slots[name] = (offset, shape, dtype)
                offset += _numel(shape) * dtype.itemsize
        self.recv_bytes = offset
        self.device = groups.device
        self._recv: torch.Tensor | None = None
        self._params: dict[str, torch.Tensor] | None = None
        self.last_stats: dict[str, float] = {}

    def _recv_view(self, name: str) -> torch.Tensor:
        offset, shape, dtype = self._slots[name]
        return self._recv[offset : offset + _numel(shape) * dtype.itemsize].view(dtype).view(shape)

    @torch.no_grad()
    def to_rollout(self) -> RolloutWeights:
        """The inner sync's rollout weights plus every expert of this rank's rollout layers (views)."""
        weights = self.inner.to_rollout()
        if self._recv is None:
            self._recv = torch.empty(self.recv_bytes, dtype=torch.uint8, device=self.device)
        ops = []
        for msg in self.incoming:
            for name in msg.names:
                ops.append(dist.P2POp(dist.irecv, self._recv_view(name), peer=msg.src))
        for msg in self.outgoing:
            for name in msg.names:
                ops.append(dist.P2POp(dist.isend, self.local[name].detach(), peer=msg.dst))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        params = {n: t for n, t in weights.params.items() if not is_expert_param(n)}
        needed = self.needed_layers[self.rank]
        params.update({n: p.detach() for n, p in self.local.items() if _layer_of(n) in needed})
        params.update({n: self._recv_view(n) for n in self._slots})
        self._params = params
        sent = sum(
            self.local[n].numel() * self.local[n].element_size() for m in self.outgoing for n in m.names
        )
        stats = dict(
            getattr(self.inner, "last_stats", {})
        )  # the dense transition's figures (NaiveGather: none)
        stats["received_bytes"] = stats.get("received_bytes", 0) + self.recv_bytes
        self.last_stats = {**stats, "expert_received_bytes": self.recv_bytes, "expert_sent_bytes": sent}
        return dataclasses.replace(weights, params=params)  # the inner sync's own object stays as it was

    def to_train(self) -> None:
        """Release the received experts (unless `keep_rollout_weights`), then the inner sync's weights."""
        if not self.keep:
            if self._params is not None:
                self._params.clear()
            self._params, self._recv = None, None
        self.inner.to_train()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
