"""The update's work balanced over DP replicas (`trainer.balance_batch`, verl's name; on by default there
and here).

Each replica trains the prompt groups it rolled out. At long-tailed lengths one replica's groups can hold
far more tokens than another's, and each mini-batch's gradient all-reduce waits for the slowest replica (so
do the old/ref log-prob and value passes, which end in collectives of their own). Before the experience is
built the replicas re-deal whole groups: within each mini-batch's slice of the global batch every replica
keeps the same number of groups, and the groups go to the replicas largest first, each to the replica with
the fewest tokens so far that still has room (longest-processing-time first under equal counts). A mini-batch
keeps its groups, groups stay whole (their advantages are group-relative) and loss normalisers are summed over
DP (engine/step/update.py), so the update equals the unbalanced one up to float summation order.

verl balances the whole batch's rows once (Karmarkar-Karp over sequence lengths); balancing each
mini-batch's groups is what its optimizer steps wait on. Tokens (prompt + response) stand in for the work.

Only the groups' token counts are gathered first; the responses themselves move (one `all_gather_object`
over DP: every replica receives the whole batch's responses, then keeps its share) only where the dealt
layout differs from the rolled-out one. Dynamic sampling already holds the global batch
(engine/step/collect.py) and deals it without a further exchange.

Measured: scripts/bench/README.md, "DP balance" (`scripts/bench/dp_balance.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.step.batch import Responses, response_lengths
from engine.step.dynamic_sampling import global_order, mini_batch_slices
from parallel.state import ProcessGroups


def group_tokens(responses: Responses) -> torch.Tensor:
    """(groups,) int64: each prompt group's tokens, prompt + response over its n rows."""
    prompts = torch.tensor([len(r.prompt_ids) for r in responses.records], dtype=torch.long)
    generated = response_lengths(responses.response_mask).view(responses.num_groups, responses.n).sum(-1)
    return prompts * responses.n + generated


def deal(tokens: list[int], parts: int) -> list[list[int]]:
    """Indices of `tokens` into `parts` lists of equal size (len(tokens) must divide), largest first, each to
    the part with the fewest tokens that still has room (the lower part on ties); each list ascending."""
    size = len(tokens) // parts
    dealt: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        part = min((p for p in range(parts) if len(dealt[p]) < size), key=lambda p: (totals[p], p))
        dealt[part].append(i)
        totals[part] += tokens[i]
    return [sorted(d) for d in dealt]


def balanced_slices(tokens: list[int], dp_size: int, num_mini_batches: int) -> list[list[int]]:
    """Per replica, the positions in the global batch (of len(tokens) groups, `tokens` each) it trains, mini-batch
    by mini-batch in the loader's layout: each mini-batch's slice dealt over the replicas (`deal`)."""
    per_mini = len(tokens) // num_mini_batches
    slices: list[list[int]] = [[] for _ in range(dp_size)]
    for start in range(0, len(tokens), per_mini):
        for r, part in enumerate(deal(tokens[start : start + per_mini], dp_size)):
            slices[r].extend(start + i for i in part)
    return slices


def slowest_over_mean(tokens: list[int], slices: list[list[int]], num_mini_batches: int) -> float:
    """Sum over mini-batches of the most tokens one replica holds, over the sum of the replicas' mean: 1.0 when
    every replica has the same work in every mini-batch (the update's time waiting on the slowest, relative)."""
    dp_size, share = len(slices), len(slices[0]) // num_mini_batches
    slowest = mean = 0.0
    for m in range(num_mini_batches):
        held = [sum(tokens[p] for p in s[m * share : (m + 1) * share]) for s in slices]
        slowest += max(held)
        mean += sum(held) / dp_size
    return slowest / max(mean, 1.0)


def rolled_out_slices(num_groups: int, dp_size: int, num_mini_batches: int) -> list[list[int]]:
    """Per replica, the positions in the global batch it rolled out (the prompt loader's layout)."""
    return [mini_batch_slices(num_groups, r, dp_size, num_mini_batches) for r in range(dp_size)]


def imbalance_metrics(
    tokens: list[int], rolled_out: list[list[int]], slices: list[list[int]], minis: int
) -> dict:
    """`perf/dp_imbalance` of the dealt `slices` and `perf/dp_imbalance_rolled_out` of the loader's layout."""
    return {
        "perf/dp_imbalance_rolled_out": slowest_over_mean(tokens, rolled_out, minis),
        "perf/dp_imbalance": slowest_over_mean(tokens, slices, minis),
    }


def balanced_share(
    batch: Responses, dp_rank: int, dp_size: int, num_mini_batches: int
) -> tuple[Responses, dict[str, float]]:
    """Replica `dp_rank`'s groups of the global `batch` (in the loader's order), dealt by tokens, and the
    `imbalance_metrics`."""
    tokens = group_tokens(batch).tolist()
    slices = balanced_slices(tokens, dp_size, num_mini_batches)
    rolled_out = rolled_out_slices(len(tokens), dp_size, num_mini_batches)
    return batch.select(slices[dp_rank]), imbalance_metrics(tokens, rolled_out, slices, num_mini_batches)


def balance(
    responses: Responses, groups: ProcessGroups, num_mini_batches: int
) -> tuple[Responses, dict[str, float]]:
    """This replica's groups after re-dealing every replica's `responses` (its share of the loader's batch)
    over `groups.dp`, and `perf/dp_imbalance` (after) and `perf/dp_imbalance_rolled_out` (before), each
    `slowest_over_mean`."""
    dp_size = groups.dims.dp
    mine = group_tokens(responses).to(groups.device)
    gathered = [torch.empty_like(mine) for _ in range(dp_size)]
    dist.all_gather(gathered, mine, group=groups.dp)
    num_groups = responses.num_groups * dp_size
    rolled_out = rolled_out_slices(num_groups, dp_size, num_mini_batches)
    tokens = [0] * num_groups
    for r in range(dp_size):
        for pos, count in zip(rolled_out[r], gathered[r].tolist()):
            tokens[pos] = count
    slices = balanced_slices(tokens, dp_size, num_mini_batches)
    metrics = imbalance_metrics(tokens, rolled_out, slices, num_mini_batches)
    if slices == rolled_out:
        return responses, metrics
    parts: list[Responses | None] = [None] * dp_size
    dist.all_gather_object(parts, responses, group=groups.dp)
    return global_order(parts, num_mini_batches).select(slices[groups.dp_rank]), metrics
