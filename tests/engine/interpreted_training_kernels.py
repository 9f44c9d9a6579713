"""The update's Triton kernels under Triton's interpreter (TRITON_INTERPRET=1) on the CPU, in float16, against
their float32 op chains: the fused output head's forward statistics and backward (engine/models/triton_logprobs.py)
and `linear_log_probs` through them, the MLP's SwiGLU (engine/models/triton_swiglu.py), the training RMSNorm
(triton_rms_norm.py) and RoPE (triton_rope.py), the shared-prompt split attention's merge (triton_lse_merge.py).
The rollout's kernels: interpreted_triton.py.

Not collected by the test run itself: tests/engine/test_triton_cpu.py runs it in a subprocess with the
interpreter switched on (see interpreted_triton.py for why, and why float16).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/engine/test_triton_cpu.py"

from norm_check import assert_no_further_than_torch  # noqa: E402

DT = torch.float16


def test_head_gradient_kernel_matches_the_op_chain():
    """The fused output head's backward kernel (engine/models/triton_logprobs.py) against `_grad_logits` run
    eagerly on the same float16 chunk: columns past a block boundary, TP-padding columns, targets on and off
    this rank's slice."""
    from engine.models import triton_logprobs
    from engine.models.fused_logprobs import _grad_logits

    g = torch.Generator().manual_seed(5)
    rows, vocab, pad_from, inv_t = 6, 2 * triton_logprobs.BLOCK + 37, 2 * triton_logprobs.BLOCK + 30, 1 / 0.7
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(DT)
    z = logits.float() * inv_t
    shift = z[:, :pad_from].logsumexp(-1)
    ent, g_logp, g_ent = (torch.randn(rows, generator=g) for _ in range(3))
    local_t = torch.randint(0, pad_from, (rows,), generator=g)
    in_shard = torch.tensor([True, False, True, True, False, True])
    args = (logits, shift, ent, g_logp, g_ent, local_t, in_shard, inv_t, pad_from)
    out = triton_logprobs.grad_logits(*args)
    ref = _grad_logits(*args)
    assert out.dtype == DT and out.shape == logits.shape
    assert out[:, pad_from:].abs().max() == 0
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-4, rtol=1e-3)


def test_head_statistics_kernel_matches_the_op_chain():
    """The fused output head's forward kernel (engine/models/triton_logprobs.py `row_stats`, an online
    log-sum-exp over blocks) against `_local_stats` run eagerly on the same float16 chunk: rows whose largest
    logit lies in a late block (the running max rescales the sums), TP-padding columns, targets on and off
    this rank's slice; and two vocabulary halves merged as two TP ranks' (`_combine`'s rescaling, here by
    hand) equal the whole."""
    from engine.models import triton_logprobs
    from engine.models.fused_logprobs import _local_stats

    g = torch.Generator().manual_seed(7)
    block = triton_logprobs.STATS_BLOCK
    rows, vocab, pad_from, inv_t = 5, 2 * block + 37, 2 * block + 30, 1 / 0.7
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(DT)
    logits[1, 2 * block + 5] = 40.0  # the max in the last block: the first two blocks' sums rescale
    logits[2, 3] = 40.0
    local_t = torch.randint(0, pad_from, (rows,), generator=g)
    in_shard = torch.tensor([True, False, True, True, False])
    got = triton_logprobs.row_stats(logits, local_t, in_shard, inv_t, pad_from)
    want = _local_stats(logits, local_t, in_shard, inv_t, pad_from)
    assert got.shape == (4, rows) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    halves = [(0, block + 11), (block + 11, vocab)]
    parts = [
        triton_logprobs.row_stats(
            logits[:, a:b], local_t - a, in_shard & (local_t >= a) & (local_t < b), inv_t, pad_from - a
        )
        for a, b in halves
    ]
    m = torch.maximum(parts[0][0], parts[1][0])
    w = [(p[0] - m).exp() for p in parts]
    s = sum(wi * p[1] for wi, p in zip(w, parts))
    a = sum(wi * (p[2] + (p[0] - m) * p[1]) for wi, p in zip(w, parts))
    torch.testing.assert_close(torch.stack([m, s, a]), want[:3], atol=1e-4, rtol=1e-5)


def test_output_head_backward_through_the_triton_kernel():
    """linear_log_probs in float16 under the interpreter takes the Triton kernels; its log-probs and entropies
    match the float64 log-softmax's within 1e-3 and its gradients within float16 rounding (1e-2 of the
    largest entry)."""
    from engine.models import fused_logprobs, triton_logprobs

    assert fused_logprobs._grad_logits_fn(torch.device("cpu"), DT) is triton_logprobs.grad_logits
    assert fused_logprobs._local_stats_fn(torch.device("cpu"), DT) is triton_logprobs.row_stats
    g = torch.Generator().manual_seed(6)
    rows, hidden, vocab = 40, 32, 3000
    h = (torch.randn(rows, hidden, generator=g) * 0.5).to(DT).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.2).to(DT).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=g)
    g_logp, g_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    logp, ent = fused_logprobs.linear_log_probs(h, w, t, vocab_size=vocab, rows_per_chunk=16)
    gh, gw = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (h, w))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ls = (h64 @ w64.t()).log_softmax(-1)
    ref = (ls.gather(1, t[:, None])[:, 0] * g_logp.double()).sum() - (
        (ls.exp() * ls).sum(-1) * g_ent.double()
    ).sum()
    rgh, rgw = torch.autograd.grad(ref, (h64, w64))
    assert (logp.double() - ls.gather(1, t[:, None])[:, 0]).abs().max() < 1e-3
    assert (ent.double() + (ls.exp() * ls).sum(-1)).abs().max() < 1e-3
    for a, b in ((gh, rgh), (gw, rgw)):
        assert (a.double() - b).abs().max() < 1e-2 * b.abs().max()


def test_swiglu_kernels_match_the_float32_chain():
    """The MLP's SwiGLU forward and backward kernels (engine/models/triton_swiglu.py) against silu(y1) * y2 and
    its autograd in float32 on the same float16 input, columns past a block boundary; and megatron's MLP hook
    routes a bias-free input through them."""
    from megatron.core.transformer import mlp

    from engine.models import triton_swiglu

    g = torch.Generator().manual_seed(7)
    half = triton_swiglu.BLOCK + 37
    y = (torch.randn(2, 3, 2 * half, generator=g) * 2).to(DT).requires_grad_()
    grad = torch.randn(2, 3, half, generator=g).to(DT)
    out = triton_swiglu.swiglu(y)
    (dy,) = torch.autograd.grad(out, (y,), grad)
    y32 = y.detach().float().requires_grad_()
    y1, y2 = y32.chunk(2, -1)
    ref = F.silu(y1) * y2
    (ref_dy,) = torch.autograd.grad(ref, (y32,), grad.float())
    assert out.dtype == DT and out.shape == (2, 3, half) and dy.dtype == DT
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(dy.float(), ref_dy, atol=2e-3, rtol=2e-3)
    triton_swiglu.install_swiglu_kernels()
    triton_swiglu.install_swiglu_kernels()  # idempotent: one wrapper
    assert mlp.bias_swiglu_impl.engine_swiglu
    assert torch.equal(mlp.bias_swiglu_impl(y.detach(), None), out.detach())


@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_kernels_match_float32_autograd(hidden):
    """engine/models/triton_rms_norm.py (37 rows, more than the backward's programs: each loops over rows; a
    width that is not a power of two) against a float32 autograd of the reference norm times the weight: y, dx
    and the weight's gradient at least as close (within 1.5x, largest and mean error) as torch's path on the
    same float16 inputs; the forward equals torch's path but for the mean's summation order."""
    from engine.models import triton_rms_norm

    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(37, 1, hidden, generator=g) * 3).to(DT)
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(DT)
    grad = torch.randn(37, 1, hidden, generator=g).to(DT)
    assert triton_rms_norm.supported(x, w) and not triton_rms_norm.supported(x, w.float())
    fused = functools.partial(triton_rms_norm.rms_norm, eps=1e-6)
    assert_no_further_than_torch(x, w, grad, fused, slack_max=1e-3, slack_mean=1e-4)
    y = triton_rms_norm.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, w * F.rms_norm(x, (hidden,), eps=1e-6), atol=2e-3, rtol=2.0**-9)


def test_training_rope_kernel_matches_the_reference_both_ways():
    """engine/models/triton_rope.py against `rope_reference` in float32 on the same float16 input: sbhd on a
    strided view (6 of 8 heads of a projection), angles whose halves differ (the kernel reads both), forward
    and the gradient through it; packed rows by position (`positions` from cu_seqlens) against the reference
    on the gathered angles."""
    from engine.models import triton_rope
    from engine.models.spec import packed_positions, rope_reference

    g = torch.Generator().manual_seed(11)
    s, b, dim = 5, 3, 32
    big = torch.randn(s, b, 8, dim, generator=g).to(DT)
    t = big[:, :, :6].requires_grad_()
    freqs = torch.rand(9, 1, 1, dim, generator=g) * 6
    assert triton_rope.supported(t, freqs) and not t.is_contiguous()
    grad = torch.randn(s, b, 6, dim, generator=g).to(DT)
    out = triton_rope.rope(t, freqs)
    (dt,) = torch.autograd.grad(out, (t,), grad)
    t32 = t.detach().float().requires_grad_()
    ref = rope_reference(t32, freqs[:s])
    (ref_dt,) = torch.autograd.grad(ref, (t32,), grad.float())
    assert out.dtype == DT and dt.dtype == DT
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(dt.float(), ref_dt, atol=2e-3, rtol=2e-3)
    packed = torch.randn(7, 2, dim, generator=g).to(DT)
    positions = packed_positions(torch.tensor([0, 3, 7]), 7)
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 3]
    got = triton_rope.rope(packed[:, None], freqs, positions)[:, 0]
    want = rope_reference(packed[:, None].float(), freqs[positions])[:, 0]
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("form", ["dense", "varlen"])
def test_split_attention_merge_kernel_matches_merge_parts(form):
    """The shared-prompt split's merge as one Triton kernel (engine/models/triton_lse_merge.py) against
    `merge_parts` run eagerly on the same float16 parts, in the views the split hands it: the dense form's
    (G, n, R, heads[, dim]) of head-major outputs and log-sum-exps, and the varlen form's (tokens, heads[, dim])
    with the output written over the self part and the log-sum-exps transposed slices; heads not a power of
    two, both log-sum-exp buffers rewritten with the union's."""
    from engine.models import triton_lse_merge
    from engine.models.shared_prompt_split import merge_parts

    g = torch.Generator().manual_seed(3)
    heads, dim = 3, 16
    if form == "dense":
        groups, n, r = 2, 3, 5
        o_self = (
            torch.randn(groups * n, heads, r, dim, generator=g)
            .to(DT)
            .transpose(1, 2)
            .unflatten(0, (groups, n))
        )
        o_cross = (
            torch.randn(groups, heads, n * r, dim, generator=g).to(DT).transpose(1, 2).unflatten(1, (n, r))
        )
        l_self = (
            (torch.randn(groups * n, heads, r, generator=g) * 3).transpose(1, 2).unflatten(0, (groups, n))
        )
        l_cross = (torch.randn(groups, heads, n * r, generator=g) * 3).transpose(1, 2).unflatten(1, (n, r))
        out = torch.empty(groups, n, r, heads, dim, dtype=DT)
    else:
        tokens = 11
        o_self = torch.randn(tokens, heads, dim, generator=g).to(DT)
        o_cross = torch.randn(tokens, heads, dim, generator=g).to(DT)
        l_self = (torch.randn(heads, tokens + 4, generator=g) * 3)[:, 2 : 2 + tokens].T
        l_cross = (torch.randn(heads, tokens, generator=g) * 3).T
        out = o_self
    parts = (o_self, l_self, o_cross, l_cross, out)
    assert triton_lse_merge.supported(*parts)
    ref = [x.clone() for x in parts]
    merge_parts(*ref)
    got = [x.clone() for x in parts]
    if form == "varlen":
        got[4] = got[0]  # the output over the self part, as the varlen split writes it
    triton_lse_merge.merge_parts(*got)
    torch.testing.assert_close(got[4].float(), ref[4].float(), atol=1e-3, rtol=1e-3)
    for i in (1, 3):
        torch.testing.assert_close(got[i], ref[i], atol=1e-5, rtol=1e-5)
