"""Routed experts of an expert-parallel model brought to the ranks that write a Hugging Face export, one
layer at a time (used by `engine.models.hf.save_hf_checkpoint` at parallel.ep > 1).

At parallel.ep > 1 each expert-parallel rank holds num_experts / ep experts of every MoE layer of its stage
(megatron's `local_experts.{i}` is global expert ep_rank * num_experts / ep + i), whole (expert TP is 1).
The export reads a stage from one rank, its writer (TP rank 0 of DP replica 0), which needs every expert of
the stage's layers. `ExpertStream` plans the messages with the rollout's rank math
(`parallel.expert_gather.plan_expert_messages`, the writer taking the role of a rank that needs all its
stage's layers: it receives each block of experts it lacks from one of the block's holders, possibly a rank
outside DP replica 0) and runs them layer by layer, in the order the writer walks its parameters: the writer
holds at most one layer's received experts before handing them on (to the file writer or to global rank 0,
as the dense tensors are).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.models.builder import ModelShape
from parallel.expert_gather import plan_expert_messages
from parallel.rollout_weights import global_param_names, is_expert_param, split_layer_name
from parallel.state import ProcessGroups


class ExpertStream:
    """The per-layer expert exchange of one export. Collective: construct on every rank (same order), then
    every rank of DP replica 0 calls `exchange(layer)` as its parameter walk reaches a layer's experts and
    every other rank calls `serve()`."""

    def __init__(self, chunks: list[torch.nn.Module], shape: ModelShape, groups: ProcessGroups):
        layers = groups.dims.train_layout().layers(groups.pp_rank, shape.num_layers)
        named = global_param_names(chunks, layers, groups.expert_offset(shape.moe.num_experts))
        self.local = {n: p for n, p in named.items() if is_expert_param(n)}
        self.writer = groups.tp_rank == 0 and groups.dp_rank == 0
        self.device = groups.device
        needed = frozenset(i for r in layers for i in r) if self.writer else frozenset()
        held = {n: (tuple(p.shape), p.dtype) for n, p in self.local.items()}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (held, needed))
        messages = plan_expert_messages([e[0] for e in everyone], [e[1] for e in everyone])
        rank = groups.rank
        self.incoming: dict[int, list[tuple[int, str, tuple, torch.dtype]]] = {}
        self.outgoing: dict[int, list[tuple[int, str]]] = {}
        for msg in messages:
            for name in msg.names:
                layer = _layer_of(name)
                if msg.dst == rank:
                    self.incoming.setdefault(layer, []).append((msg.src, name, *everyone[msg.src][0][name]))
                if msg.src == rank:
                    self.outgoing.setdefault(layer, []).append((msg.dst, name))
        self.layers = list(dict.fromkeys(_layer_of(n) for n in self.local))  # the walk's order

    @torch.no_grad()
    def exchange(self, layer: int) -> dict[str, torch.Tensor]:
        """Run layer `layer`'s messages. On the writer: every expert tensor of the layer by global name
        (its own as views of the parameters, the others received); elsewhere: {}."""
        received = {
            name: torch.empty(size, dtype=dtype, device=self.device)
            for _, name, size, dtype in self.incoming.get(layer, ())
        }
        ops = [dist.P2POp(dist.irecv, received[n], peer=src) for src, n, *_ in self.incoming.get(layer, ())]
        ops += [
            dist.P2POp(dist.isend, self.local[n].detach(), peer=dst)
            for dst, n in self.outgoing.get(layer, ())
        ]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if not self.writer:
            return {}
        own = {n: p.detach() for n, p in self.local.items() if _layer_of(n) == layer}
        return {**own, **received}

    def serve(self) -> None:
        """A rank outside DP replica 0: send its share of every layer's experts, in the writer's order."""
        for layer in self.layers:
            self.exchange(layer)


def _layer_of(name: str) -> int:
    return split_layer_name(name)[0]
