"""Dealing a step's prompt groups over DP replicas by tokens (engine/step/balance.py): equal group counts per
replica in every mini-batch, each mini-batch's groups kept, the slowest replica's share against hand-computed
values. Over real replicas through the trainer (`balance`, gloo, DP=4, the same update with and without):
tests/engine/test_trainer_multirank.py."""

from __future__ import annotations

import random

import pytest
import torch

from engine.data import PromptRecord
from engine.step.balance import balanced_share, balanced_slices, deal, group_tokens, slowest_over_mean
from engine.step.batch import Responses
from engine.step.dynamic_sampling import mini_batch_slices


def test_deal_largest_first_to_the_lightest_part_with_room():
    # 9 -> part 0, 8 -> part 1, 7 -> part 1 (8 < 9; now full), 1 -> part 0
    assert deal([9, 1, 8, 7], 2) == [[0, 1], [2, 3]]
    assert deal([10, 10, 1, 1], 2) == [[0, 2], [1, 3]]
    assert deal([5, 5, 5, 5], 4) == [[0], [1], [2], [3]]  # ties: the lower part
    # equal counts: 6 -> 0, 2 -> 1, 2 -> 1 (full), the last 2 -> 0 though 1 is lighter (6 vs 4)
    assert deal([6, 2, 2, 2], 2) == [[0, 3], [1, 2]]


def test_balanced_slices_keep_each_mini_batch_and_equal_counts():
    rnd = random.Random(0)
    for dp, minis, groups in ((2, 1, 8), (2, 2, 16), (4, 2, 32), (3, 3, 18)):
        tokens = [int(rnd.lognormvariate(5, 1)) for _ in range(groups)]
        slices = balanced_slices(tokens, dp, minis)
        per_mini, share = groups // minis, groups // minis // dp
        assert all(len(s) == groups // dp for s in slices)
        for m in range(minis):  # the mini-batch's groups, all of them, each once
            held = sorted(p for s in slices for p in s[m * share : (m + 1) * share])
            assert held == list(range(m * per_mini, (m + 1) * per_mini)), (dp, minis, m)
        rolled_out = [mini_batch_slices(groups, r, dp, minis) for r in range(dp)]
        assert slowest_over_mean(tokens, slices, minis) <= slowest_over_mean(tokens, rolled_out, minis)


def test_slowest_over_mean_hand_computed():
    tokens = [10, 10, 1, 1]
    rolled_out = [mini_batch_slices(4, r, 2, 1) for r in range(2)]  # [0, 1] and [2, 3]: 20 vs 2
    assert rolled_out == [[0, 1], [2, 3]]
    assert slowest_over_mean(tokens, rolled_out, 1) == pytest.approx(20 / 11)
    assert balanced_slices(tokens, 2, 1) == [[0, 2], [1, 3]]
    assert slowest_over_mean(tokens, [[0, 2], [1, 3]], 1) == 1.0
    # two mini-batches: each one's slowest replica counts: (20 + 7) / (11 + 6)
    assert slowest_over_mean([10, 10, 1, 1, 7, 5, 0, 0], [[0, 1, 4, 6], [2, 3, 5, 7]], 2) == pytest.approx(
        27 / 17
    )


def responses(lengths: list[int], prompt_lens: list[int], n: int, width: int, first: int) -> Responses:
    """Groups of `n` rows with these response `lengths` (row-major) and prompts; scores name the row."""
    rows = len(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    ids = torch.arange(rows * width).view(rows, width) * mask.long()
    records = [PromptRecord(list(range(p)), "src", "0", index=first + g) for g, p in enumerate(prompt_lens)]
    scores = torch.arange(first * n, first * n + rows, dtype=torch.float32)
    return Responses(records, n, ids, mask, None, torch.ones(rows), scores)


def test_group_tokens_and_balanced_share_move_whole_groups():
    batch = responses([3, 4, 9, 9, 1, 1, 2, 2], [5, 6, 7, 8], 2, 9, 0)
    assert group_tokens(batch).tolist() == [5 * 2 + 7, 6 * 2 + 18, 7 * 2 + 2, 8 * 2 + 4]
    mine, metrics = balanced_share(batch, 1, 2, 1)  # tokens 17, 30, 16, 20: 30+16 vs 17+20
    assert [r.index for r in mine.records] == [0, 3]
    assert mine.scores.tolist() == [0.0, 1.0, 6.0, 7.0]  # the groups' rows, in order
    assert metrics["perf/dp_imbalance"] == pytest.approx(46 / 41.5)
    assert metrics["perf/dp_imbalance_rolled_out"] == pytest.approx(47 / 41.5)
