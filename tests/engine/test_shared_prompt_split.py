"""The shared-prompt layout's dense split (engine/models/shared_prompt_split.py) on the CPU with its float
reference kernel (`MATH`): against the gathered layout's attention (each response's keys its prompt's copy
then its own, the CPU path of engine/models/shared_prompt_attention.py) on micro-batches the trainer builds
(engine/roles/shared_prompts.py), forward and backward; both kernel layouts (the output in q's strides as
cuDNN writes it, or contiguous); the device check that falls back; and where the layout is uniform."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.models import shared_prompt_split as split_module
from engine.models.packed_attention import segment_attention
from engine.models.shared_prompt_split import MATH, LseKernel, in_strides, split_attention, split_available
from engine.roles.dynamic_batch import MicroBatcher
from engine.step.batch import build_experience

CPU = torch.device("cpu")


def experience(prompt_lens: list[int], response_lens: list[int], n: int, vocab: int = 50):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (p,), generator=gen).tolist() for p in prompt_lens]
    width = max(response_lens)
    lengths = torch.tensor(response_lens)
    mask = (torch.arange(width) < lengths[:, None]).float()
    response_ids = torch.randint(4, vocab, (len(response_lens), width), generator=gen) * mask.long()
    exp = build_experience(prompts, response_ids, mask, list(range(len(prompts))), n, 0)
    exp.tensors["advantages"] = torch.randn(len(response_lens), width, generator=gen) * mask
    exp.tensors["rollout_log_probs"] = -torch.rand(len(response_lens), width, generator=gen) * mask
    return exp


def micro_batches(exp, multiple: int = 1, budget: int = 4096) -> list[dict]:
    return MicroBatcher(4, budget, multiple, CPU, pack=True, share_prompts=True)(exp, torch.arange(exp.num_rows))


def test_prompts_first_then_responses_and_the_uniform_shape():
    exp = experience([5, 5, 5], [4] * 6, n=2)
    (mb,) = micro_batches(exp)
    params, tokens = mb["packed_seq_params"], mb["tokens"][0]
    assert params.uniform == (3, 2, 5, 4)
    for u in range(3):  # each prompt once in the prompts block, its responses in the responses block
        assert tokens[5 * u : 5 * u + 5].tolist() == exp.tokens[2 * u, :5].tolist()
    rows = mb["rows"].tolist()
    for i, r in enumerate(rows):
        assert tokens[15 + 4 * i : 19 + 4 * i].tolist() == exp.tokens[r, 5:9].tolist()
    assert mb["positions"][0, 15:19].tolist() == [5, 6, 7, 8]
    # a response of another length, a prompt of another length, padding: no single shape
    assert micro_batches(experience([5, 5, 5], [4, 4, 4, 3, 4, 4], n=2))[0]["packed_seq_params"].uniform is None
    assert micro_batches(experience([5, 6, 5], [4] * 6, n=2))[0]["packed_seq_params"].uniform is None
    assert micro_batches(exp, multiple=8)[0]["packed_seq_params"].uniform is None


def gathered(q, k, v, params, scale):
    """The gathered layout's CPU attention (shared_prompt_attention without its RoPE-positions check)."""
    idx = params.kv_index
    return segment_attention(q, k[idx], v[idx], params.cu_seqlens_q, params.cu_seqlens_k, scale, 0.0)


def inputs(t: int, heads: int, groups: int, dim: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, dim, generator=gen, dtype=torch.float64) for h in (heads, groups, groups))
    grad = torch.randn(t, heads, dim, generator=gen, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)], grad.to(dtype)


def run(fn, leaves, grad):
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, grad)]


def strided_like_q(kernel: LseKernel) -> LseKernel:
    """`kernel` returning its output in q's strides and a (b, heads, s) log-sum-exp: cuDNN's layouts."""

    def forward(q, k, v, causal, scale):
        out, lse, state = kernel.forward(q, k, v, causal, scale)
        return in_strides(out, q), lse[..., 0].clone(), state

    return LseKernel(forward, kernel.backward)


@pytest.mark.parametrize("groups", [4, 2])
@pytest.mark.parametrize("layout", ["contiguous", "like_q"])
def test_split_equals_gathered_keys(groups, layout):
    """float64, 4 query heads: output and q/k/v gradients equal the gathered layout's within 1e-10."""
    exp = experience([5, 5, 5], [7] * 9, n=3)
    (mb,) = micro_batches(exp)
    params = mb["packed_seq_params"]
    assert params.uniform == (3, 3, 5, 7)
    kernel = MATH if layout == "contiguous" else strided_like_q(MATH)
    leaves, grad = inputs(mb["tokens"].shape[1], 4, groups, 8, torch.float64)
    got = run(lambda q, k, v: split_attention(q, k, v, params.uniform, 0.3, kernel), leaves, grad)
    want = run(lambda q, k, v: gathered(q, k, v, params, 0.3), leaves, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=name)


def test_split_in_bfloat16_rounds_near_the_gathered_keys():
    """bfloat16 in, the reference kernel computing in float32 and rounding its output: each part rounded once,
    then merged in float32 and rounded again. Against float64 the split's largest error stays within twice
    the gathered layout's plus one bf16 ulp of the output's scale."""
    (mb,) = micro_batches(experience([6, 6], [10] * 8, n=4))
    params = mb["packed_seq_params"]
    leaves, grad = inputs(mb["tokens"].shape[1], 4, 2, 16, torch.float64, seed=1)
    exact = run(lambda q, k, v: gathered(q, k, v, params, None), leaves, grad)
    low = [x.detach().bfloat16().requires_grad_() for x in leaves]
    split = run(lambda q, k, v: split_attention(q, k, v, params.uniform, None, MATH), low, grad.bfloat16())
    gather = run(lambda q, k, v: gathered(q, k, v, params, None), low, grad.bfloat16())
    for name, s, g, e in zip(("out", "dq", "dk", "dv"), split, gather, exact):
        ulp = e.abs().max().item() * 2**-8
        err_split, err_gather = ((x.double() - e).abs().max().item() for x in (s, g))
        assert err_split <= 2 * err_gather + ulp, (name, err_split, err_gather)


def test_a_kernel_that_strays_or_raises_is_not_used(caplog):
    q, k = torch.zeros(4, 6, 16), torch.zeros(4, 3, 16)
    split_module._AVAILABLE.clear()
    try:
        with torch.no_grad():  # as from the old log-probs' forward
            assert split_available(q, k, MATH)

        def skewed(q, k, v, causal, scale):
            out, lse, state = MATH.forward(q, k, v, causal, scale)
            return out * 1.2, lse, state

        def missing(*args):
            raise RuntimeError("no such op")

        for kernel in (LseKernel(skewed, MATH.backward), LseKernel(missing, MATH.backward)):
            split_module._AVAILABLE.clear()
            with caplog.at_level(logging.WARNING, logger=split_module.__name__):
                assert not split_available(q, k, kernel)
        assert "no such op" in caplog.text and "strays" in caplog.text
    finally:
        split_module._AVAILABLE.clear()


def test_the_trainer_with_the_split_equals_packed_rows(tmp_path, monkeypatch):
    """A fixed-length step (8-token prompts, 12-token responses, 4 rows per prompt, two prompts per
    micro-batch) through the real model with every shared micro-batch's attention split (the reference kernel
    standing in for cuDNN): log-probs, entropies, values, last-token scores, the actor's and critic's loss and
    gradients against the same rows packed whole, float32, the tolerances of the gathered layout's test
    (tests/engine/test_dynamic_batch.py)."""
    from trainer_parity import packing_parity

    from engine.models import shared_prompt_attention as shared_module

    calls = []

    def split(q, k, v, uniform, scale):
        calls.append(uniform)
        return split_attention(q, k, v, uniform, scale, MATH)

    monkeypatch.setattr(shared_module, "flash_applies", lambda q, dropout_p: True)
    monkeypatch.setattr(shared_module, "RECURRING", lambda shape: True)
    monkeypatch.setattr(shared_module, "split_available", lambda q, k: True)
    monkeypatch.setattr(shared_module, "split_attention", split)
    parity = packing_parity([], str(tmp_path), 112, shared=True, uniform=True)
    assert calls and set(calls) == {(2, 4, 8, 12)}, set(calls)
    for key in ("log_probs", "entropy", "values", "scores"):
        assert parity[key] <= 2e-5, parity
    for key in ("actor_grad_rel", "actor_loss_rel", "critic_grad_rel", "critic_loss_rel"):
        assert parity[key] <= 1e-5, parity
    assert parity["tokens_shared"] < parity["tokens_packed"], parity
