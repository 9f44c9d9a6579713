"""The native rollout's flash prefill layout (engine/rollout/model.py `prefill_flash`,
engine/rollout/attention_kernels.py `flash_prefill_offsets`) on CPU: the same plumbing with a plain-torch varlen
causal attention in place of FlashAttention-2, against the masked SDPA prefill, on tiny random Hugging Face
checkpoints read through the project's weight map (tests/engine/test_rollout_native.py). The flash kernel itself
runs in tests/engine/test_rollout_gpu.py."""

from __future__ import annotations

import hf_tiny
import pytest
import torch
from test_rollout_native import random_prompts, rollout_weights_from_hf

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """family -> (shape, weights) for the two families below."""
    root = tmp_path_factory.mktemp("prefill_hf")
    seeds = {"qwen2": 0, "qwen3": 2}  # test_rollout_native.py's checkpoints
    return {
        f: rollout_weights_from_hf(hf_tiny.save_tiny(f, str(root / f), seed=seed))
        for f, seed in seeds.items()
    }


def varlen_causal_reference(q, k, v, cum: torch.Tensor) -> torch.Tensor:
    """What `flash_varlen_prefill` computes, in plain torch: causal attention within each sequence of `cum`
    over the flattened tokens (GQA: query head h reads KV group h // heads per group). (u * n, heads, dim)."""
    u, n, g, pg, hd = q.shape
    seq = torch.bucketize(torch.arange(u * n), cum[1:].long(), right=True)  # each token's sequence
    tok = torch.arange(u * n)
    allowed = (seq[:, None] == seq[None, :]) & (tok[None, :] <= tok[:, None])
    qf = q.reshape(u * n, g * pg, hd).transpose(0, 1)  # (heads, tokens, dim)
    kf = k.reshape(u * n, g, hd).transpose(0, 1).repeat_interleave(pg, 0)
    vf = v.reshape(u * n, g, hd).transpose(0, 1).repeat_interleave(pg, 0)
    out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed)
    return out.transpose(0, 1).contiguous()  # as FlashAttention-2 returns it


@pytest.mark.parametrize(
    "family,lens,offsets",  # pads 0, 4, 0, 6, 2 (sequence 0 empty); 2, 4, 0, 6, 0
    [
        ("qwen2", (7, 3, 7, 1, 5), [0, 0, 11, 14, 27, 30, 35]),
        ("qwen3", (5, 3, 7, 1, 7), [0, 2, 11, 14, 27, 28, 35]),
    ],
)
def test_varlen_prefill_layout_equals_the_masked_prefill(tiny, family, lens, offsets, monkeypatch):
    """The flash prefill's plumbing (sequence offsets over left-padded rows, GQA heads as they are, output
    view) run on CPU with a plain-torch varlen causal attention in its place: the same last-position logits
    and the same K/V at every real position as the masked SDPA prefill (float32, 1e-5)."""
    from engine.rollout import model as rollout_model
    from engine.rollout.kv_cache import KVCachePool
    from engine.rollout.rope import rope_tables

    shape, weights = tiny[family]
    rope = rope_tables(shape, CPU, torch.float32)
    prompts = random_prompts(shape.vocab_size, lens)
    n = max(map(len, prompts))
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
    pad = torch.tensor([n - len(p) for p in prompts])
    rows = torch.arange(len(prompts))
    out = {}
    for flash in (False, True):
        model = rollout_model.RolloutModel(shape, weights, rope)
        model.prefill_flash = flash
        monkeypatch.setattr(rollout_model, "flash_varlen_prefill", varlen_causal_reference)
        pool = KVCachePool(shape.num_layers, model.groups, model.head_dim, torch.float32, CPU, 1 << 24)
        k, v = pool.views(len(prompts), n)
        with torch.inference_mode():
            out[flash] = (model.prefill(ids, pad, k, v, rows), [t.clone() for t in k], [t.clone() for t in v])
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5, rtol=0)
    for r, p in enumerate(pad.tolist()):
        for a, b in zip(out[True][1] + out[True][2], out[False][1] + out[False][2]):
            assert torch.allclose(a[r, p:], b[r, p:], atol=1e-5, rtol=0)
    assert rollout_model.flash_prefill_offsets(pad, n).tolist() == offsets
