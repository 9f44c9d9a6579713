"""Token-budget micro-batches: the grouping rule, the cut micro-batches (padded and packed), loss/gradient parity
with fixed micro-batches, and packed vs padded parity of every forward head and both updates, on one rank
(world size 1; the TP=2 x PP=2 parities, SP on and off, run in test_trainer_multirank.py)."""

from __future__ import annotations

import random

import pytest
import torch
from trainer_parity import dynamic_batch_parity, packing_parity, skewed_experience

from engine.roles.dynamic_batch import (
    GRAPH_FILL,
    MicroBatcher,
    _padding_rows,
    one_layout,
    pack_by_token_budget,
    padded_length,
)


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


@pytest.mark.parametrize("multiple", [1, 2])
def test_packed_grouping_counts_real_tokens(multiple):
    rng = random.Random(1)
    lengths = [rng.choice([2, 3, 5, 40, 61]) for _ in range(60)]
    groups = pack_by_token_budget(lengths, 128, multiple, packed=True)
    assert sorted(i for g in groups for i in g) == list(range(60))
    order = sorted(range(60), key=lambda i: (-lengths[i], i))  # placement order: longest first
    placed = {i: n for n, i in enumerate(order)}
    rounded = lambda tokens: -(-tokens // multiple) * multiple  # noqa: E731
    for k, group in enumerate(groups):
        assert rounded(sum(lengths[i] for i in group)) <= 128 or len(group) == 1
        assert [placed[i] for i in group] == sorted(placed[i] for i in group)
        for i in group:  # first fit: no earlier group had room for it when it was placed
            for earlier in groups[:k]:
                before = sum(lengths[j] for j in earlier if placed[j] < placed[i])
                assert rounded(before + lengths[i]) > 128, (i, earlier)
    # the padded rule counts rows x longest and needs more micro-batches for the same rows
    assert len(groups) < len(pack_by_token_budget(lengths, 128, multiple))


@pytest.mark.parametrize("budget", [64, 0])  # 0: a budget of micro_batch_size x the batch's width
def test_packed_micro_batches_lay_rows_back_to_back(budget):
    exp = skewed_experience(0, 16, 12, vocab=50, pad_id=0)
    lengths = exp.prompt_lens + exp.response_mask.sum(-1).long()
    full_index = exp.response_index()
    mbs = MicroBatcher(4, budget, 2, torch.device("cpu"), pack=True)(exp, torch.arange(16), ("advantages",))
    assert sorted(r for mb in mbs for r in mb["rows"].tolist()) == list(range(16))
    if not budget:  # the padded layout's tokens per micro-batch, real tokens only: fewer micro-batches
        width = exp.tokens.shape[1]
        groups = pack_by_token_budget(lengths.tolist(), 4 * width, 2, packed=True)
        assert [mb["rows"].tolist() for mb in mbs] == groups and len(groups) < 16 // 4
    for mb in mbs:
        rows, lens = mb["rows"], lengths[mb["rows"]]
        params = mb["packed_seq_params"]
        t = mb["tokens"].shape[1]
        assert mb["tokens"].shape[0] == 1 and t <= (budget or 4 * exp.tokens.shape[1])
        assert t % 2 == 0 and t - int(lens.sum()) < 2
        cu = params.cu_seqlens_q.tolist()
        assert params.qkv_format == "thd" and cu[0] == 0 and cu[-1] == t and params.max_seqlen_q <= max(t, 64)
        assert params.max_seqlen_q == max(int(lens.max()), t - int(lens.sum()))
        assert cu[: len(rows) + 1] == [0, *torch.cumsum(lens, 0).tolist()]
        for r, start, length in zip(rows.tolist(), mb["row_starts"].tolist(), lens.tolist()):
            assert torch.equal(mb["tokens"][0, start : start + length], exp.tokens[r, :length])
            assert torch.equal(mb["positions"][0, start : start + length], torch.arange(length))
        valid = mb["response_mask"].bool()
        assert torch.equal(mb["response_index"][valid], full_index[rows][valid])
        assert (mb["response_index"] < lens[:, None]).all()
        assert torch.equal(mb["advantages"], exp.tensors["advantages"][rows])


@pytest.mark.parametrize("multiple", [1, 2])
@pytest.mark.parametrize("shapes", ["one", "graphs"])  # the interleaved schedule's; the CUDA graphs'
def test_packed_micro_batches_padded_to_one_layout(multiple, shapes):
    """`shapes="one"`: every packed micro-batch of a call (4 rows in order) has one (t, segments, max_seqlen);
    "graphs": those of at least GRAPH_FILL of the largest one's tokens (grouped by width), the others as "free". The
    rows as without it, the padding split into pseudo-rows of 1 to max_seqlen tokens after them."""
    exp = skewed_experience(0, 28, 12, vocab=50, pad_id=0)
    lengths = exp.prompt_lens + exp.response_mask.sum(-1).long()
    cpu = torch.device("cpu")
    same = MicroBatcher(4, 0, multiple, cpu, pack=True, shapes=shapes)(exp, torch.arange(28))
    if shapes == "one":  # each micro-batch's rows packed alone (a call of one: nothing to pad it to)
        free = [
            MicroBatcher(4, 0, multiple, cpu, pack=True, shapes="one")(exp, torch.arange(i, i + 4))[0]
            for i in range(0, 28, 4)
        ]
        assert all(torch.equal(mb["rows"], torch.arange(i, i + 4)) for mb, i in zip(same, range(0, 28, 4)))
    else:
        free = MicroBatcher(4, 0, multiple, cpu, pack=True)(exp, torch.arange(28))
        assert len({mb["packed_seq_params"].cu_seqlens_q.numel() for mb in free}) > 1  # rows per group differ
    assert len({mb["tokens"].shape[1] for mb in free}) > 1  # the rows' lengths differ: so would the shapes
    longest = int(lengths.max())
    totals = [int(lengths[mb["rows"]].sum()) for mb in free]
    t = max(mb["tokens"].shape[1] for mb in free)
    padded = [shapes == "one" or total >= GRAPH_FILL * max(totals) for total in totals]
    first = same[padded.index(True)]
    assert sum(padded) >= 2 and (shapes == "one" or not all(padded))  # "graphs": the last one is small
    for a, b, total, pad in zip(free, same, totals, padded):
        assert torch.equal(a["rows"], b["rows"])
        if not pad:  # small: its own shape
            assert total < GRAPH_FILL * max(totals) and torch.equal(a["tokens"], b["tokens"])
            pa, pb = a["packed_seq_params"], b["packed_seq_params"]
            assert torch.equal(pa.cu_seqlens_q, pb.cu_seqlens_q) and pa.max_seqlen_q == pb.max_seqlen_q
            continue
        params = b["packed_seq_params"]
        segments = params.cu_seqlens_q.numel() - 1  # a token per pseudo-row at most beyond the longest
        assert t <= b["tokens"].shape[1] < t + segments + multiple and b["tokens"].shape[1] % multiple == 0
        assert params.max_seqlen_q == params.max_seqlen_kv == longest
        assert params.cu_seqlens_q.shape == first["packed_seq_params"].cu_seqlens_q.shape
        assert b["tokens"].shape == first["tokens"].shape
        assert (
            torch.equal(b["tokens"][:, :total], a["tokens"][:, :total]) and not b["tokens"][:, total:].any()
        )
        cu = params.cu_seqlens_q.tolist()
        rows = len(a["rows"]) + 1
        assert cu[:rows] == a["packed_seq_params"].cu_seqlens_q.tolist()[:rows]
        assert cu[-1] == b["tokens"].shape[1]
        pseudo = torch.tensor(cu[rows - 1 :]).diff()
        assert ((pseudo >= 1) & (pseudo <= longest)).all() and int(pseudo.max() - pseudo.min()) <= 1
        assert torch.equal(b["positions"][0, total:], torch.cat([torch.arange(n) for n in pseudo.tolist()]))
        for key in ("row_starts", "row_lengths", "response_index", "response_valid"):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("multiple", [1, 2, 8])
def test_one_layout_fits_every_micro_batch(multiple):
    """Random long-tailed calls: each micro-batch's padding fits its pseudo-rows (1 to max_seqlen tokens)."""
    rng = random.Random(multiple)
    for _ in range(200):
        groups = [
            [rng.choice([1, 2, 3, 50, 400]) for _ in range(rng.randint(1, 9))]
            for _ in range(rng.randint(1, 6))
        ]
        t, segments, longest = one_layout(groups, multiple)
        assert longest == max(map(max, groups)) and t % multiple == 0
        assert t < max(map(sum, groups)) + segments + multiple  # padding: a token per segment at most
        for g in groups:
            room = segments - len(g)
            assert room >= 0 and room <= t - sum(g) <= room * longest, (groups, t, segments)


def test_equal_rows_stay_equal_under_one_layout():
    """A fixed-length call's last, smaller micro-batch is padded with pseudo-rows as long as its rows, so every
    micro-batch stays a (rows, length) batch (the cuDNN path of engine/models/packed_attention.py)."""
    t, segments, longest = one_layout([[7] * 4, [7] * 4, [7] * 2], 1)
    assert (t, segments, longest) == (28, 4, 7)
    assert _padding_rows(14, 2) == [7, 7]


@pytest.mark.parametrize("one_layout", [False, True])
def test_packed_equals_padded_forward_and_backward(tmp_path, one_layout):
    """Tiny GQA model (4 heads, 2 groups), rows of 3 to 36 tokens: log-probs, entropies, values, last-token
    scores, and the actor's and critic's loss and gradients, packed (with `one_layout`: padded to one layout
    per call, as for CUDA graphs) vs padded."""
    parity = packing_parity([], str(tmp_path), 64, one_layout=one_layout)
    # float32: the layouts differ in summation order only
    for key in ("log_probs", "entropy", "values", "scores"):
        assert parity[key] <= 2e-5, parity
    for key in ("actor_grad_rel", "actor_loss_rel", "critic_grad_rel", "critic_loss_rel"):
        assert parity[key] <= 1e-5, parity
    if one_layout:  # padded to the call's longest micro-batch (under this small budget: more than padded)
        assert parity["tokens_real"] < parity["tokens_packed"], parity
    else:
        assert parity["tokens_packed"] == parity["tokens_real"] < parity["tokens_padded"], parity


@pytest.mark.parametrize("budget", [64, 40])  # 40: groups split over micro-batches, each with its prompt
def test_shared_prompts_equal_packed_rows_forward_and_backward(tmp_path, budget):
    """trainer.share_prompts (engine/roles/shared_prompts.py): 4 rows per prompt, each group's prompt laid out
    once per micro-batch, against the same rows packed whole: log-probs, entropies, values, last-token scores,
    the actor's and critic's loss and gradients, float32."""
    parity = packing_parity([], str(tmp_path), budget, shared=True)
    for key in ("log_probs", "entropy", "values", "scores"):
        assert parity[key] <= 2e-5, parity
    for key in ("actor_grad_rel", "actor_loss_rel", "critic_grad_rel", "critic_loss_rel"):
        assert parity[key] <= 1e-5, parity
    # the prompts once: fewer tokens computed than the rows hold (2 to 24 prompt tokens, 4 rows each)
    assert (
        parity["tokens_shared"] < parity["tokens_packed"] and parity["tokens_real"] < parity["row_tokens"]
    ), parity


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


@pytest.mark.parametrize(
    "overrides,vpp,graphs,shapes",
    [
        ((), 1, False, "free"),
        ((), 1, True, "graphs"),
        ((), 2, False, "one"),
        ((), 2, True, "one"),  # validation refuses graphs with pp > 1; the interleaved layout wins regardless
        (("trainer.pack_sequences=false",), 1, True, "graphs"),  # padded: unused
    ],
)
def test_trainer_batcher_shapes(overrides, vpp, graphs, shapes):
    """The trainer's micro-batch shapes: one layout per call for the interleaved schedule (rows in order) and
    where the layers run from CUDA graphs, each micro-batch its own otherwise."""
    from config_compose import composed

    from engine.roles.dynamic_batch import trainer_batcher
    from parallel.dims import ParallelDims

    cfg = composed(*overrides)
    dims = ParallelDims(world_size=2 * vpp if vpp > 1 else 1, pp=2 if vpp > 1 else 1, vpp=vpp)
    batcher = trainer_batcher(cfg.trainer, dims, torch.device("cpu"), graphs)
    assert batcher.shapes == shapes and batcher.fixed_rows == (shapes == "one" or not batcher.pack)
