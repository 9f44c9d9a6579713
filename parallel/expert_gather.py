"""The rollout's routed experts at expert parallelism: the rollout runs every expert on each rank (rollout EP
is 1), so after the TP/PP transition the experts of the expert-parallel group are all-gathered.

`ExpertGather` wraps a `WeightSync` (the 3D-HybridEngine or the naive gather): `to_rollout` hands over the
inner sync's weights with each local expert `...local_experts.{i}...` replaced by all experts of the group,
named by global index (expert-parallel rank j's local expert i is global expert j * local experts + i);
`to_train` drops the gathered copies and lets the inner sync restore the training layout. The gathered
experts cost the rollout (ep - 1) / ep of the expert weights on top of the local ones, and one copy of the
local experts (all_gather writes every member's slot). Only layouts whose inner transition is a view of the
training weights per rank are supported (rollout.tp = parallel.tp, parallel.pp = 1: engine/validate/ says so),
so every rank's inner weights name its own local experts.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist

from parallel.rollout_weights import RolloutWeights, WeightSync, is_expert_param
from parallel.state import ProcessGroups

_LOCAL = re.compile(r"^(.*\.local_experts\.)(\d+)(\..+)$")


class ExpertGather:
    """A `WeightSync` whose rollout weights hold every routed expert (gathered over the EP group)."""

    def __init__(self, inner: WeightSync, groups: ProcessGroups, num_experts: int):
        if groups.experts is None:
            raise ValueError("ExpertGather needs the expert-parallel groups (ProcessGroups.experts)")
        self.inner, self.group = inner, groups.experts.ep
        self.ep = groups.dims.ep
        self.num_local = num_experts // self.ep
        self._gathered: list[torch.Tensor] = []

    def to_rollout(self) -> RolloutWeights:
        weights = self.inner.to_rollout()
        params = {n: t for n, t in weights.params.items() if not is_expert_param(n)}
        for name in sorted(n for n in weights.params if is_expert_param(n)):  # one order on every rank
            local = weights.params[name].contiguous()
            parts = [torch.empty_like(local) for _ in range(self.ep)]
            dist.all_gather(parts, local, group=self.group)
            head, index, tail = _LOCAL.match(name).groups()
            for rank, part in enumerate(parts):
                params[f"{head}{rank * self.num_local + int(index)}{tail}"] = part
            self._gathered += parts
        return dataclasses.replace(weights, params=params)  # the inner sync's own object stays as it was

    def to_train(self) -> None:
        self._gathered = []
        self.inner.to_train()
