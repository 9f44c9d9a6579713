"""Token-budget micro-batches: the packing rule, the cut micro-batches, and loss/gradient parity with fixed
micro-batches on one rank (world size 1; the TP=2 x PP=2 parity runs in test_trainer_multirank.py)."""

from __future__ import annotations

import random

import pytest
import torch
from trainer_run_script import dynamic_batch_parity, skewed_experience

from engine.roles.dynamic_batch import MicroBatcher, pack_by_token_budget, padded_length


@pytest.mark.parametrize("multiple", [1, 2])
def test_packing_respects_the_budget_and_keeps_every_row_once(multiple):
    rng = random.Random(0)
    lengths = [rng.randint(1, 60) for _ in range(50)]
    groups = pack_by_token_budget(lengths, 128, multiple)
    assert sorted(i for g in groups for i in g) == list(range(50))
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(lengths, reverse=True)  # longest first
    for g in groups:
        longest = padded_length(lengths[g[0]], multiple)
        assert longest % multiple == 0
        assert len(g) * longest <= 128
    # greedy: the next group's first row would not have fit
    for a, b in zip(groups, groups[1:]):
        assert b and (len(a) + 1) * padded_length(lengths[a[0]], multiple) > 128


def test_a_row_longer_than_the_budget_goes_alone():
    assert pack_by_token_budget([10, 3, 3], 8) == [[0], [1, 2]]


def test_micro_batches_are_cut_to_their_longest_row():
    exp = skewed_experience(0, 16, 12, vocab=50, pad_id=0)
    lengths = exp.prompt_lens + exp.response_mask.sum(-1).long()
    full_index = exp.response_index()
    mbs = MicroBatcher(4, 64, 1, torch.device("cpu"))(exp, torch.arange(16), ("advantages",))
    assert sorted(r for mb in mbs for r in mb["rows"].tolist()) == list(range(16))
    for mb in mbs:
        b, s = mb["tokens"].shape
        assert b * s <= 64
        assert s == int(lengths[mb["rows"]].max()) + 1
        assert torch.equal(mb["tokens"], exp.tokens[mb["rows"], :s])
        valid = mb["response_mask"].bool()
        assert torch.equal(mb["response_index"][valid], full_index[mb["rows"]][valid])
        assert int(mb["response_index"].max()) <= s - 2
        assert torch.equal(mb["advantages"], exp.tensors["advantages"][mb["rows"]])


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_token_budget_gives_the_same_loss_and_gradient(tmp_path, mode):
    parity = dynamic_batch_parity([f"algorithm.loss_agg_mode={mode}"], str(tmp_path), 64)
    # float32: the two splits differ only in summation order
    assert parity["loss_diff"] <= 1e-5 * abs(parity["loss_fixed"]), parity
    assert parity["grad_diff"] <= 1e-5 * parity["grad_scale"], parity
    assert parity["tokens_budget"] < 0.7 * parity["tokens_fixed"], parity


@pytest.mark.parametrize("pp,vpp", [(2, 1), (2, 2), (4, 2)])
def test_pipeline_rows_fill_micro_batches_and_the_interleaved_count(pp, vpp):
    """Forward-only calls at PP > 1 (engine/step/update.py forward_rows): every row once in order, then the
    last row repeated to whole micro-batches, and for vpp > 1 to a count that is a multiple of pp."""
    from engine.step.update import pipeline_rows

    for num_rows in range(1, 41):
        rows = pipeline_rows(num_rows, 5, pp, vpp)
        count = len(rows) // 5
        assert len(rows) % 5 == 0 and torch.equal(rows[:num_rows], torch.arange(num_rows))
        assert (rows[num_rows:] == num_rows - 1).all()
        assert count == -(-num_rows // 5) or (vpp > 1 and count % pp == 0 and count - pp < -(-num_rows // 5))
        assert vpp == 1 or count % pp == 0
