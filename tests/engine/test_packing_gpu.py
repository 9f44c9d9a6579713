"""Packed micro-batches on CUDA (marked `gpu`, skipped on CPU): torch's varlen attention kernel in bfloat16 against
padded micro-batches (SDPA) of the same rows. World size 1 (in-process, one GPU, NCCL).

Tolerance, bfloat16 (2 layers, hidden 256, 8 heads in 2 query groups, head dim 32): the two layouts run
different attention kernels and round activations at different points, so log-probs and entropies differ by
bfloat16 rounding, not by masking: within 5e-2 absolute (a masking error, e.g. a row attending to its
neighbour, moves them by O(1)), parameter gradients and losses within 5e-2 of their scale.
"""

from __future__ import annotations

import pytest
from trainer_parity import packing_parity

from engine.models import spec

pytestmark = pytest.mark.gpu

MODEL = [
    "cluster=single_gpu",
    "model.dtype=bfloat16",
    "model.hidden_size=256",
    "model.ffn_hidden_size=512",
    "model.num_attention_heads=8",
    "model.num_query_groups=2",
]


def test_varlen_packed_equals_padded_in_bfloat16(tmp_path, monkeypatch):
    attend = spec._varlen_attn()
    assert attend is not None, "torch has no torch.nn.attention.varlen"
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return attend(*args)

    monkeypatch.setattr(spec, "_VARLEN", [spy])
    parity = packing_parity(MODEL, str(tmp_path), 64)
    assert calls, "the packed forward did not reach the varlen kernel"
    for key in ("log_probs", "entropy"):
        assert parity[key] <= 5e-2, parity
    for key in ("actor_grad_rel", "actor_loss_rel", "critic_grad_rel", "critic_loss_rel"):
        assert parity[key] <= 5e-2, parity
    assert parity["tokens_packed"] == parity["tokens_real"] < parity["tokens_padded"], parity
