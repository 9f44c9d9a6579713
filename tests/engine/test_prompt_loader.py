"""engine/prompt_loader.py: epochs, DP shares, mini-batch slices, exact resumes and what a resume refuses."""

import pytest

from engine.data import PromptRecord
from engine.prompt_loader import PromptLoader


def records(n):
    return [PromptRecord([i], "s", str(i), {}, i) for i in range(n)]


def indices(batch):
    return [r.index for r in batch]


def test_loader_deterministic_and_epochs():
    a, b = PromptLoader(records(10), 4, seed=1, dp_rank=0, dp_size=1), PromptLoader(records(10), 4, 1, 0, 1)
    batches = [indices(a.next_batch()) for _ in range(6)]
    assert batches == [indices(b.next_batch()) for _ in range(6)]
    assert batches != [
        indices(b.next_batch()) for b in [PromptLoader(records(10), 4, 2, 0, 1)] for _ in range(6)
    ]
    epoch0, epoch1 = batches[0] + batches[1], batches[2] + batches[3]
    assert len(set(epoch0)) == 8 and len(set(epoch1)) == 8  # 2 batches per epoch, tail of 2 dropped
    assert epoch0 != epoch1  # a new permutation per epoch
    assert a.epoch == 2 and a.num_batches_per_epoch == 2
    plain = PromptLoader(records(10), 4, 1, 0, 1, shuffle=False)
    assert [indices(plain.next_batch()) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    assert "2 of the 10 prompts are left out of each, always the same last ones" in plain.tail_note()
    assert (
        "other ones each epoch" in a.tail_note() and PromptLoader(records(8), 4, 1, 0, 1).tail_note() is None
    )


def test_dp_ranks_take_consecutive_shares_of_the_global_batch():
    whole = PromptLoader(records(20), 8, seed=5, dp_rank=0, dp_size=1)
    ranks = [PromptLoader(records(20), 8, seed=5, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(5):  # crosses epoch boundaries (2 batches per epoch)
        shares = [indices(loader.next_batch()) for loader in ranks]
        assert all(len(share) == 2 for share in shares)
        assert sum(shares, []) == indices(whole.next_batch())


def test_mini_batches_are_the_same_prompts_at_every_dp_size():
    """The update cuts each rank's rows into consecutive mini-batches: mini-batch i over all ranks must be
    slice i of the global batch, as at DP=1 (the normaliser and the step then see the same prompts)."""
    for dp in (1, 2, 4):
        ranks = [PromptLoader(records(20), 8, 5, r, dp, num_mini_batches=2) for r in range(dp)]
        whole = PromptLoader(records(20), 8, 5, 0, 1)
        per_rank = 4 // dp  # prompts of one mini-batch on one rank
        for _ in range(3):  # crosses an epoch boundary
            shares = [indices(loader.next_batch()) for loader in ranks]
            minis = [sum((share[i * per_rank : (i + 1) * per_rank] for share in shares), []) for i in (0, 1)]
            global_batch = indices(whole.next_global_batch())
            assert minis == [global_batch[:4], global_batch[4:]], dp
    with pytest.raises(ValueError, match="algorithm.num_mini_batches=3 must divide"):
        PromptLoader(records(20), 8, 5, 0, 2, num_mini_batches=3)


@pytest.mark.parametrize("stop_after", [1, 2, 3])  # mid-epoch, exactly at the boundary, just after it
def test_resume_gives_exactly_the_next_batch(stop_after):
    first = PromptLoader(records(10), 4, seed=3, dp_rank=1, dp_size=2)
    for _ in range(stop_after):
        first.next_batch()
    resumed = PromptLoader(records(10), 4, seed=3, dp_rank=1, dp_size=2)
    resumed.load_state_dict(dict(first.state_dict()))
    assert [indices(resumed.next_batch()) for _ in range(4)] == [
        indices(first.next_batch()) for _ in range(4)
    ]


def test_loader_errors():
    with pytest.raises(
        ValueError, match=r"data.batch_size=6 must be a positive multiple of the data-parallel size 4"
    ):
        PromptLoader(records(10), 6, 0, 0, 4)
    with pytest.raises(ValueError, match=r"data.batch_size=16 is larger than the dataset \(10 prompts"):
        PromptLoader(records(10), 16, 0, 0, 1)
    state = PromptLoader(records(10), 4, 0, 0, 1).state_dict()
    with pytest.raises(ValueError, match=r"cannot resume the prompt loader.*num_records"):
        PromptLoader(records(12), 4, 0, 0, 1).load_state_dict(state)
    # the same number of prompts but other ones (a file rewritten in place), or another order: refused
    other = [PromptRecord([i + 100], "s", str(i), {}, i) for i in range(10)]
    with pytest.raises(ValueError, match=r"cannot resume the prompt loader.*'fingerprint'.*engine.export"):
        PromptLoader(other, 4, 0, 0, 1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"cannot resume the prompt loader.*'shuffle': \(1, 0\)"):
        PromptLoader(records(10), 4, 0, 0, 1, shuffle=False).load_state_dict(state)
    old = {k: v for k, v in state.items() if k not in ("shuffle", "fingerprint")}  # an older checkpoint
    PromptLoader(records(10), 4, 0, 0, 1).load_state_dict(old)
