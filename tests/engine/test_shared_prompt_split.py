"""The shared-prompt layout's split at each response's prompt (engine/models/shared_prompt_split.py) on the
CPU with the float reference kernels (engine/models/lse_kernels.py `MATH`, `MATH_VARLEN`): against the gathered
layout's attention (each response's keys its prompt's copy then its own, the CPU path of
engine/models/shared_prompt_attention.py) on micro-batches the trainer builds (engine/roles/shared_prompts.py),
forward and backward, dense (one shape) and varlen; both dense kernel layouts (the output in q's strides as
cuDNN writes it, or contiguous); the device check that falls back; the layout's blocks, shape and cross
segments; and a trainer's update through the real model with the split."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.models import shared_prompt_split as split_module
from engine.models.lse_kernels import MATH, MATH_VARLEN, LseKernel, in_layout
from engine.models.packed_attention import segment_attention
from engine.models.shared_prompt_split import split_attention, split_available, varlen_split_attention
from engine.roles.dynamic_batch import MicroBatcher
from engine.roles.shared_prompts import cross_segments
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
    return MicroBatcher(4, budget, multiple, CPU, pack=True, share_prompts=True)(
        exp, torch.arange(exp.num_rows)
    )


def test_prompts_first_then_responses_the_uniform_shape_and_the_cross_segments():
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
    cross = params.cross
    assert (cross.prompt_tokens, cross.response_tokens, cross.max_q, cross.max_k) == (15, 24, 8, 5)
    assert cross.cu_q.tolist() == [0, 8, 16, 24] and cross.cu_k.tolist() == [0, 5, 10, 15]
    # a response of another length, a prompt of another length, padding: no single shape
    assert (
        micro_batches(experience([5, 5, 5], [4, 4, 4, 3, 4, 4], n=2))[0]["packed_seq_params"].uniform is None
    )
    assert micro_batches(experience([5, 6, 5], [4] * 6, n=2))[0]["packed_seq_params"].uniform is None
    padded = micro_batches(exp, multiple=8)[0]["packed_seq_params"]
    assert padded.uniform is None and padded.cross.response_tokens == 24  # the padding is in no cross segment


def test_cross_segments_leave_out_units_without_responses_and_refuse_what_they_cannot_express():
    units = [[0, 1], [2], [3, 4]]
    cross = cross_segments(units, [4, 2, 3], [5, 0, 2, 0, 0], CPU)  # the last unit without responses
    assert cross.cu_q.tolist() == [0, 5, 7] and cross.cu_k.tolist() == [0, 4, 6] and cross.keys == (0, 6)
    assert (cross.prompt_tokens, cross.response_tokens, cross.max_q, cross.max_k) == (9, 7, 5, 4)
    cross = cross_segments(units, [4, 2, 3], [5, 0, 0, 1, 2], CPU)
    assert cross is None  # a unit without responses between two with them: its prompt's keys in no segment
    cross = cross_segments(units, [4, 2, 3], [0, 0, 1, 2, 3], CPU)  # the first without: keys from 4
    assert cross.cu_q.tolist() == [0, 1, 6] and cross.cu_k.tolist() == [4, 6, 9] and cross.keys == (4, 9)
    assert cross_segments(units, [4, 0, 3], [5, 0, 1, 2, 2], CPU) is None  # responses without a prompt


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
        return in_layout(out, (out.shape, q.stride())), lse[..., 0].clone(), state

    return LseKernel(forward, kernel.backward)


@pytest.mark.parametrize("groups", [4, 2])
@pytest.mark.parametrize("layout", ["contiguous", "like_q"])
def test_dense_split_equals_gathered_keys(groups, layout):
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


def varlen(q, k, v, params, scale, kernel=MATH_VARLEN):
    p = params
    return varlen_split_attention(q, k, v, p.cu_seqlens_q, p.max_q, p.cross, scale, kernel)


@pytest.mark.parametrize("groups", [4, 2])
@pytest.mark.parametrize("multiple", [1, 8])  # 8: padding after the responses block
def test_varlen_split_equals_gathered_keys(groups, multiple):
    """Prompts of 3 to 9 tokens, responses of 1 to 11, groups of 3 cut over two micro-batches, one with a
    prompt's responses split off (a budget below its group's tokens): float64, 4 query heads, output and
    q/k/v gradients equal the gathered layout's within 1e-10."""
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 10, (5,), generator=gen).tolist()
    exp = experience(prompts, torch.randint(1, 12, (15,), generator=gen).tolist(), n=3)
    mbs = micro_batches(exp, multiple, budget=60)
    assert len(mbs) > 1 and all(mb["packed_seq_params"].uniform is None for mb in mbs)
    for mb in mbs:
        params = mb["packed_seq_params"]
        assert params.cross is not None
        leaves, grad = inputs(mb["tokens"].shape[1], 4, groups, 8, torch.float64)
        got = run(lambda q, k, v, p=params: varlen(q, k, v, p, 0.3), leaves, grad)
        want = run(lambda q, k, v, p=params: gathered(q, k, v, p, 0.3), leaves, grad)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=name)


def test_varlen_split_with_prompts_in_no_cross_segment():
    """The first and the last prompt's responses all empty (their units in no cross segment: the reference
    kernel's gradient rows for their keys are NaN, as FlashAttention-2 leaves them unwritten): float64,
    output and q/k/v gradients equal the gathered layout's."""
    (mb,) = micro_batches(experience([10, 4, 6], [0, 0, 3, 2, 0, 0], n=2))  # laid out by cost: 10, 4 + 5, 6
    params = mb["packed_seq_params"]
    assert params.cross.keys == (10, 14) and params.cross.prompt_tokens == 20
    assert params.cross.cu_q.tolist() == [0, 5]
    leaves, grad = inputs(mb["tokens"].shape[1], 4, 2, 8, torch.float64)
    got = run(lambda q, k, v: varlen(q, k, v, params, 0.3), leaves, grad)
    want = run(lambda q, k, v: gathered(q, k, v, params, 0.3), leaves, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=name)


@pytest.mark.parametrize("form", ["dense", "varlen"])
def test_split_in_bfloat16_rounds_near_the_gathered_keys(form):
    """bfloat16 in, the reference kernels computing in float32 and rounding their outputs: each part rounded
    once, then merged in float32 and rounded again. Against float64 the split's largest error stays within
    twice the gathered layout's plus one bf16 ulp of the output's scale."""
    lengths = [10] * 8 if form == "dense" else [10, 3, 7, 1, 9, 10, 2, 5]
    (mb,) = micro_batches(experience([6, 6], lengths, n=4))
    params = mb["packed_seq_params"]
    assert (params.uniform is None) == (form == "varlen")
    leaves, grad = inputs(mb["tokens"].shape[1], 4, 2, 16, torch.float64, seed=1)
    exact = run(lambda q, k, v: gathered(q, k, v, params, None), leaves, grad)
    low = [x.detach().bfloat16().requires_grad_() for x in leaves]
    if form == "dense":
        fn = lambda q, k, v: split_attention(q, k, v, params.uniform, None, MATH)  # noqa: E731
    else:
        fn = lambda q, k, v: varlen(q, k, v, params, None)  # noqa: E731
    split = run(fn, low, grad.bfloat16())
    gather = run(lambda q, k, v: gathered(q, k, v, params, None), low, grad.bfloat16())
    for name, s, g, e in zip(("out", "dq", "dk", "dv"), split, gather, exact):
        ulp = e.abs().max().item() * 2**-8
        err_split, err_gather = ((x.double() - e).abs().max().item() for x in (s, g))
        assert err_split <= 2 * err_gather + ulp, (name, err_split, err_gather)


def skewed_kernel(kernel):
    """`kernel` with its output 20% off: what the device check must catch."""

    def forward(*args):
        out, lse, state = kernel.forward(*args)
        return out * 1.2, lse, state

    return type(kernel)(forward, kernel.backward)


def missing_kernel(kernel):
    def forward(*args):
        raise RuntimeError("no such op")

    return type(kernel)(forward, kernel.backward)


@pytest.mark.parametrize("reference", [MATH, MATH_VARLEN])
def test_a_kernel_that_strays_or_raises_is_not_used(caplog, reference):
    qkv = torch.zeros(4, 6 + 3 + 3, 16)  # views into one projection, as megatron's: rows 192 elements apart
    q, k, v = qkv.split([6, 3, 3], dim=1)
    split_module._AVAILABLE.clear()
    try:
        with torch.no_grad():  # as from the old log-probs' forward
            assert split_available(q, k, v, reference)
        for kernel in (skewed_kernel(reference), missing_kernel(reference)):
            with caplog.at_level(logging.WARNING, logger=split_module.__name__):
                assert not split_available(q, k, v, kernel)
        assert "no such op" in caplog.text and "strays" in caplog.text
    finally:
        split_module._AVAILABLE.clear()


def test_the_merge_compiles_once_for_the_check_and_every_shape(monkeypatch):
    """On CUDA the merge is compiled (engine/models/compiled.py) and each compile costs seconds, once. The
    device check's half-precision case and real micro-batches of other shapes share one graph (symbolic sizes)
    and the check's float32 reference merges eagerly; with the sizes specialised they compiled three times.
    torch.compile's front end with its `eager` backend (graphs, no kernels) stands in for CUDA's here."""
    import torch._dynamo

    compiled = {}

    def cpu_kernel(fn, device, switch, dynamic=True):
        return compiled.setdefault(fn.__qualname__, torch.compile(fn, dynamic=dynamic, backend="eager"))

    monkeypatch.setattr(split_module, "cuda_kernel", cpu_kernel)
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    stats.clear()
    qkv = torch.zeros(4, 4 + 2 + 2, 16, dtype=torch.bfloat16)  # views into one projection, as megatron's
    q, k, v = qkv.split([4, 2, 2], dim=1)
    split_module._AVAILABLE.clear()
    try:
        assert split_available(q, k, v, MATH)  # bf16 split and its float32 reference
        for g, n, p, r in ((3, 4, 8, 12), (2, 2, 5, 7)):
            t = g * (p + n * r)
            leaves = [torch.randn(t, h, 16, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2)]
            split_attention(*leaves, (g, n, p, r), None, MATH).float().sum().backward()
        assert stats["unique_graphs"] == 1, dict(stats)
    finally:
        split_module._AVAILABLE.clear()
        torch._dynamo.reset()


@pytest.mark.parametrize("lengths", ["uniform", "skewed"])
def test_the_trainer_with_the_split_equals_packed_rows(tmp_path, monkeypatch, lengths):
    """One step's micro-batches through the real model (a PPO job's actor and critic) with every shared
    micro-batch's attention split, the reference kernels standing in for the device's (cuDNN, FlashAttention-2),
    against the same rows packed whole: log-probs, entropies, values, last-token scores, the actor's and
    critic's loss and gradients, float32, the tolerances of the gathered layout's test
    (tests/engine/test_dynamic_batch.py). `uniform`: 8-token prompts, 12-token responses, two prompts of 4
    rows per micro-batch (dense: cuDNN's form); `skewed`: prompts of 2 to 24 tokens, responses of 1 to 12
    (varlen: FlashAttention-2's form)."""
    from trainer_parity import packing_parity

    from engine.models import shared_prompt_attention as shared_module

    monkeypatch.setattr(shared_module, "flash_applies", lambda q, dropout_p: True)
    monkeypatch.setattr(shared_module, "RECURRING", lambda shape: True)
    monkeypatch.setattr(shared_module, "split_available", lambda q, k, v, kernel: True)
    monkeypatch.setattr(shared_module, "CUDNN", MATH)
    monkeypatch.setattr(shared_module, "FLASH_VARLEN", MATH_VARLEN)
    monkeypatch.setattr(shared_module, "SPLIT_VARLEN", True)  # off by default until measured on a GPU
    shared_module.SHARED_CALLS.since_last()
    uniform = lengths == "uniform"
    parity = packing_parity([], str(tmp_path), 112 if uniform else 64, shared=True, uniform=uniform)
    cudnn, flash, gathered_calls = shared_module.SHARED_CALLS.since_last()
    assert gathered_calls == 0 and (cudnn > 0, flash > 0) == (uniform, not uniform), (cudnn, flash)
    for key in ("log_probs", "entropy", "values", "scores"):
        assert parity[key] <= 2e-5, parity
    for key in ("actor_grad_rel", "actor_loss_rel", "critic_grad_rel", "critic_loss_rel"):
        assert parity[key] <= 1e-5, parity
    assert parity["tokens_shared"] < parity["tokens_packed"], parity
