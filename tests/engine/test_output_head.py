"""engine/models/output_head.py `response_token_stats` on micro-batches cut by MicroBatcher (padded and packed,
world size 1): the head computes the valid response tokens only (output-layer FLOPs counted by torch's
FlopCounterMode), with the same log-probs, entropies and gradients there as the head over every (row, step)
entry (float64: the two differ in the rows of each chunk only, tolerance 1e-12), and 0 elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from trainer_parity import skewed_experience

from engine.models.output_head import response_token_stats
from engine.roles.dynamic_batch import MicroBatcher

H, V = 8, 50


def head(hidden, weight, mb):
    return response_token_stats(hidden, weight, mb, temperature=0.7, vocab_size=V, tp_group=None)


@pytest.mark.parametrize("pack", [False, True])
def test_the_head_computes_valid_response_tokens_only(pack):
    exp = skewed_experience(0, 16, 12, vocab=V, pad_id=0)  # responses of 1..12 tokens: most rows end early
    mbs = MicroBatcher(4, 96, 1, torch.device("cpu"), pack=pack)(exp, torch.arange(16))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
    for mb in mbs:
        hidden = torch.randn(*mb["tokens"].shape, H, generator=gen, dtype=torch.float64, requires_grad=True)
        mask = mb["response_mask"].bool()
        num_valid = int(mask.sum())
        assert num_valid < mask.numel()
        with FlopCounterMode(display=False) as flops:
            logp, ent = head(hidden, weight, mb)
        assert flops.get_total_flops() == 2 * num_valid * H * V  # the output projection of valid tokens
        every = {k: v for k, v in mb.items() if k != "response_valid"}  # the head over every entry
        logp_all, ent_all = head(hidden, weight, every)
        torch.testing.assert_close(logp[mask], logp_all[mask], rtol=0, atol=1e-12)
        torch.testing.assert_close(ent[mask], ent_all[mask], rtol=0, atol=1e-12)
        assert not logp[~mask].any() and not ent[~mask].any()
        grads = torch.autograd.grad((logp - ent)[mask].sum(), (hidden, weight))
        grads_all = torch.autograd.grad((logp_all - ent_all)[mask].sum(), (hidden, weight))
        for g, g_all in zip(grads, grads_all):
            torch.testing.assert_close(g, g_all, rtol=0, atol=1e-12)
