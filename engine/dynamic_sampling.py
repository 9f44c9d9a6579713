"""DAPO's dynamic sampling on one DP replica: keep the prompt groups whose rewards differ, over as many
rollout rounds as it takes to fill the replica's share of the batch (or `algorithm.max_sampling_rounds`).

A group whose responses all scored the same has zero group-relative advantage: it adds no gradient, only
dilutes the loss normaliser. The trainer draws a further prompt batch while any replica is short (a
collective decision: rollout rounds are collective), and a replica that is already full generates nothing.
Departure, on purpose: when the round cap is hit the batch is completed with dropped groups (counted in
`dynamic_sampling/filler_groups`) rather than failing the run (verl raises) or shrinking the batch (which
would change the micro-batch layout mid-run). This module does no communication.
"""

from __future__ import annotations

import torch

from algorithms import dynamic_sampling_keep_mask
from engine.batch import Responses


class GroupSelector:
    """Accumulates the groups of successive rollout rounds; `finish` returns `num_groups` of them."""

    def __init__(self, num_groups: int):
        self.num_groups = num_groups
        self.kept: list[tuple[Responses, int]] = []
        self.dropped: list[tuple[Responses, int]] = []
        self.generated = 0

    @property
    def missing(self) -> int:
        """Groups still needed to fill the batch with informative ones."""
        return max(self.num_groups - len(self.kept), 0)

    def add(self, responses: Responses) -> None:
        """Sort a round's groups into kept (rewards differ, or a group of one) and dropped."""
        if responses.num_groups == 0:
            return
        groups_b = torch.arange(responses.num_groups).repeat_interleave(responses.n)
        keep_g = dynamic_sampling_keep_mask(responses.shaped_scores(), groups_b)[:: responses.n]
        for g, keep in enumerate(keep_g.tolist()):
            (self.kept if keep else self.dropped).append((responses, g))
        self.generated += responses.num_groups

    def finish(self) -> tuple[Responses, dict[str, int]]:
        """The batch: the first `num_groups` kept groups, completed with dropped ones if too few were kept;
        and counts for this replica: generated, dropped (constant reward) and filler groups."""
        filler = self.dropped[: self.missing]
        chosen = self.kept[: self.num_groups] + filler
        parts, run = [], []
        for i, (responses, g) in enumerate(chosen):  # consecutive groups of one round -> one select
            run.append(g)
            if i + 1 == len(chosen) or chosen[i + 1][0] is not responses:
                parts.append(responses.select(run))
                run = []
        stats = {"generated": self.generated, "dropped": len(self.dropped), "filler": len(filler)}
        return Responses.concat(parts), stats
