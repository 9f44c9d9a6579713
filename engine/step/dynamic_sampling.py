"""DAPO's dynamic sampling over the whole batch: keep the prompt groups whose rewards differ, over as many
rollout rounds as it takes to fill `data.batch_size` groups (or `algorithm.max_sampling_rounds`).

A group whose responses all scored the same has zero group-relative advantage: it adds no gradient, only
dilutes the loss normaliser. As verl does on its driver, the selection is global: every replica generates
its share of each round, the trainer gathers all replicas' responses (`global_order` puts them back in the
global batch's order), every replica runs the same `GroupSelector` on them, and `replica_share` hands each
replica its part of the chosen groups in the prompt loader's layout. So the chosen groups, the counts and the
mini-batches do not depend on the DP size.
Departure, on purpose: when the round cap is hit the batch is completed with dropped groups (counted in
`dynamic_sampling/filler_groups`) rather than failing the run (verl raises) or shrinking the batch (which
would change the micro-batch layout mid-run). This module does no communication.
"""

from __future__ import annotations

import torch

from algorithms.dapo import dynamic_sampling_keep_mask
from engine.step.batch import Responses


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


def mini_batch_slices(num_groups: int, dp_rank: int, dp_size: int, num_mini_batches: int) -> list[int]:
    """Positions in a global batch of `num_groups` groups that replica `dp_rank` holds: its consecutive share
    of each mini-batch's slice (engine/prompt_loader.py PromptLoader.next_batch's layout)."""
    per_mini = num_groups // num_mini_batches
    share = per_mini // dp_size
    return [i + dp_rank * share + j for i in range(0, num_groups, per_mini) for j in range(share)]


def global_order(parts: list[Responses], num_mini_batches: int) -> Responses:
    """One round's responses of all replicas (`parts[r]` from DP rank r, each its loader share) as the global
    batch's groups in order."""
    dp_size, num_groups = len(parts), sum(p.num_groups for p in parts)
    share = num_groups // dp_size  # every replica draws the same number of prompts
    order = [0] * num_groups  # global position -> index in the concatenation of the parts
    for r in range(dp_size):
        for g, pos in enumerate(mini_batch_slices(num_groups, r, dp_size, num_mini_batches)):
            order[pos] = r * share + g
    return Responses.concat(parts).select(order)


def replica_share(batch: Responses, dp_rank: int, dp_size: int, num_mini_batches: int) -> Responses:
    """Replica `dp_rank`'s groups of the chosen global batch, in the prompt loader's layout."""
    return batch.select(mini_batch_slices(batch.num_groups, dp_rank, dp_size, num_mini_batches))
