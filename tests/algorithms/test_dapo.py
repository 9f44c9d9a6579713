"""DAPO helpers: dynamic sampling keep mask and overlong reward shaping, hand-computed."""

import pytest
import torch

from algorithms.dapo import dynamic_sampling_keep_mask, overlong_penalty


def test_dynamic_sampling_hand_example():
    # groups interleaved: 0 -> all 1 (drop), 1 -> 0 and 1 (keep), 2 -> all 0 (drop), 3 -> alone (keep)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.0])
    groups = torch.tensor([0, 1, 0, 1, 2, 3, 2])
    keep = dynamic_sampling_keep_mask(scores, groups)
    assert keep.tolist() == [False, True, False, True, False, True, False]
    assert keep.dtype == torch.bool


def test_overlong_penalty_hand_example():
    # max_len 10, buffer 4: free up to 6 tokens, then -1/4 per extra token, -1 at 10
    lengths = torch.tensor([5, 6, 7, 8, 10])
    penalty = overlong_penalty(lengths, max_len=10, buffer_len=4)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]), atol=0, rtol=0)
    doubled = overlong_penalty(lengths, max_len=10, buffer_len=4, penalty_factor=2.0)
    torch.testing.assert_close(doubled, torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0]), atol=0, rtol=0)
    off = overlong_penalty(lengths, max_len=10, buffer_len=0)
    assert (off == 0).all()


def test_bad_input():
    with pytest.raises(ValueError, match="group_index_b"):
        dynamic_sampling_keep_mask(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="group_index_b"):
        dynamic_sampling_keep_mask(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="scores_b"):
        dynamic_sampling_keep_mask(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(torch.tensor([1, 2]), max_len=10, buffer_len=11)
    with pytest.raises(ValueError, match="response_lengths_b"):
        overlong_penalty(torch.tensor([[1, 2]]), max_len=10, buffer_len=4)
