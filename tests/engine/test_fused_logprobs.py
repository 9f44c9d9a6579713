"""engine/models/fused_logprobs.py against log_softmax / entropy / autograd on the full logits (float64
reference; the fused op computes in float32: tolerance 1e-5), the one-pass head (the loss's gradient in the
forward) included. Vocab-parallel (TP=2) and the integration in
MegatronRole are checked by tests/parallel/model_parity_script.py."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from engine.models.fused_logprobs import (
    CHUNK_BYTES,
    OP_CHAIN_BYTES_PER_LOGIT,
    TRITON_BYTES_PER_LOGIT,
    _default_chunk_rows,
    _local_stats,
    chunk_rows,
    chunk_slices,
    linear_log_probs,
    linear_log_probs_one_pass,
)

N, H, V, VOCAB = 13, 8, 12, 10  # 2 padded vocabulary rows


def reference(h, w, t, temperature):
    z = (h @ w.t()) / temperature
    z = torch.cat([z[:, :VOCAB], torch.full((N, V - VOCAB), -torch.inf, dtype=z.dtype)], 1)
    logp_all = z.log_softmax(-1)
    p = logp_all.exp()
    ent = -(p[:, :VOCAB] * logp_all[:, :VOCAB]).sum(-1)
    return logp_all.gather(1, t[:, None])[:, 0], ent


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    t = torch.randint(0, VOCAB, (N,), generator=g)
    return (
        h,
        w,
        t,
        torch.randn(N, generator=g, dtype=torch.float64),
        torch.randn(N, generator=g, dtype=torch.float64),
    )


@pytest.mark.parametrize("rows_per_chunk", [4, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_values_and_gradients_match_full_logits(rows_per_chunk, temperature, entropy_grad):
    h, w, t, g_logp, g_ent = inputs()
    out, ref = [], []
    for fn, sink in ((None, out), (reference, ref)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if fn is None:
            logp, ent = linear_log_probs(
                hh, ww, t, temperature=temperature, vocab_size=VOCAB, rows_per_chunk=rows_per_chunk
            )
        else:
            logp, ent = fn(hh, ww, t, temperature)
        loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)
        sink.extend([logp.detach(), ent.detach(), *torch.autograd.grad(loss, (hh, ww))])
    for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), out, ref):
        assert torch.allclose(a.double(), b, atol=1e-5, rtol=1e-5), f"{name}: {(a - b).abs().max()}"


@pytest.mark.parametrize("rows_per_chunk", [4, 64])
def test_weight_gradient_goes_into_main_grad(rows_per_chunk):
    """A weight with megatron DDP's `main_grad` (float32) gets its gradient added there, over every chunk, and
    none in .grad; a second use of the same weight (a tied embedding's lookup) still reaches .grad."""
    h, w, t, g_logp, _ = (x.float() if x.is_floating_point() else x for x in inputs(3))
    ww = w.clone().requires_grad_()
    ww.main_grad = torch.full_like(ww, 0.25)  # what earlier micro-batches left
    logp, _ = linear_log_probs(h, ww, t, vocab_size=VOCAB, rows_per_chunk=rows_per_chunk)
    lookup = ww[t].sum()  # the embedding's use of the tied weight
    ((logp * g_logp).sum() + lookup).backward()
    ref_w = w.double().requires_grad_()
    ref_logp, _ = reference(h.double(), ref_w, t, 1.0)
    (ref_grad,) = torch.autograd.grad((ref_logp * g_logp.double()).sum(), (ref_w,))
    assert torch.allclose(ww.main_grad.double(), 0.25 + ref_grad, atol=1e-5)
    assert torch.equal(ww.grad, torch.zeros_like(w).index_put_((t,), torch.ones(N, H), accumulate=True))


def test_half_precision_weight_gradient_over_chunks_matches_one_chunk():
    """bfloat16 without `main_grad`: the chunks' weight gradients, summed in a float32 buffer and rounded once,
    match the one-chunk product within bfloat16 rounding of the chunks' logits gradients."""
    h, w, t, g_logp, _ = inputs(4)
    hb, wb = h.bfloat16(), w.bfloat16().requires_grad_()
    logp, _ = linear_log_probs(hb, wb, t, vocab_size=VOCAB, rows_per_chunk=4)
    (gw,) = torch.autograd.grad((logp * g_logp.float()).sum(), (wb,))
    assert gw.dtype == torch.bfloat16
    one = wb.detach().clone().requires_grad_()
    logp1, _ = linear_log_probs(hb, one, t, vocab_size=VOCAB, rows_per_chunk=64)  # one chunk: no sum
    (gw1,) = torch.autograd.grad((logp1 * g_logp.float()).sum(), (one,))
    assert (gw.float() - gw1.float()).abs().max() <= 2e-2 * gw1.float().abs().max()


def test_padded_vocabulary_rows_get_no_probability_and_no_gradient():
    h, w, t, g_logp, _ = inputs(1)
    w = w.clone().requires_grad_()
    logp, _ = linear_log_probs(h, w, torch.full((N,), VOCAB - 1), vocab_size=VOCAB)
    (gw,) = torch.autograd.grad(logp.sum(), (w,))
    assert gw[VOCAB:].abs().max() == 0 and gw[:VOCAB].abs().max() > 0


def test_frozen_weight_and_forward_only():
    h, w, t, _, _ = inputs(2)
    hh = h.clone().requires_grad_()
    logp, _ = linear_log_probs(hh, w, t, vocab_size=VOCAB)
    (gh,) = torch.autograd.grad(logp.sum(), (hh,))  # no weight gradient requested: still exact for h
    ref_logp, _ = reference(h.clone().requires_grad_(), w, t, 1.0)
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5)
    with torch.no_grad():
        logp_ng, ent_ng = linear_log_probs(h, w, t, vocab_size=VOCAB)
    assert torch.equal(logp_ng, logp.detach()) and not logp_ng.requires_grad


def test_saves_no_logits_for_backward():
    """The point of fusing: what autograd keeps is O(rows x hidden), never O(rows x vocab)."""
    rows, hidden, vocab = 256, 16, 4096
    h = torch.randn(rows, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    saved = []

    def pack(x):
        saved.append(x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logp, ent = linear_log_probs(
            h, w, torch.randint(0, vocab, (rows,)), vocab_size=vocab, rows_per_chunk=64
        )
        (logp.sum() + ent.sum()).backward()
    logits_bytes = rows * vocab * 4
    own = (h.numel() + w.numel()) * 4  # the inputs themselves (not copies)
    assert sum(saved) - own < logits_bytes / 16, (sum(saved), logits_bytes)


def test_chunk_rows_respects_budget_and_shape_errors():
    assert chunk_rows(151_936, budget_bytes=2 << 30) * 151_936 * 10 <= 2 << 30
    assert chunk_rows(151_936, bytes_per_logit=4) * 151_936 * 4 <= CHUNK_BYTES
    assert chunk_rows(10**9) == 64
    # the CPU runs the op chains (float32 copies of the chunk): 10 bytes per logit
    w, h = torch.zeros(151_936, 4), torch.zeros(3, 4)
    assert _default_chunk_rows(w, h) == chunk_rows(151_936, bytes_per_logit=OP_CHAIN_BYTES_PER_LOGIT)
    with pytest.raises(ValueError, match="hidden rows"):
        linear_log_probs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), vocab_size=5)


def test_chunks_cover_every_row_and_none_has_one_row():
    for rows_per_chunk in (3, 4, 64):
        for n in range(1, 3 * rows_per_chunk + 2):
            chunks = chunk_slices(n, rows_per_chunk)
            assert [i for c in chunks for i in range(c.start, c.stop)] == list(range(n))
            assert all(0 < c.stop - c.start <= rows_per_chunk for c in chunks)
            assert n == 1 or all(c.stop - c.start > 1 for c in chunks), (n, rows_per_chunk, chunks)


def test_chunk_kernels_compile_once_for_every_row_count():
    """The chunk kernels as cuda_kernel compiles them (dynamic sizes), dynamo's cheap `eager` backend on CPU:
    after one compile, chunks of the micro-batches of any number of response tokens reuse it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    stats = torch.compile(_local_stats, dynamic=True, backend="eager")

    def call(x: torch.Tensor) -> None:
        rows = x.shape[0]
        stats(x, torch.zeros(rows, dtype=torch.long), torch.ones(rows, dtype=torch.bool), 1.0, VOCAB)

    call(torch.randn(7, V))  # warm-up
    graphs = counters["stats"]["unique_graphs"]
    for n in (65, 64, 129, 3):  # e.g. valid response tokens of four micro-batches
        for rows in chunk_slices(n, 64):
            call(torch.randn(n, V)[rows])
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernels_on_gpu_match_full_logits_bf16():
    """On CUDA the chunk's statistics and gradient run as Triton kernels; Qwen-sized vocabulary, bf16 weights,
    3 chunks.
    Reference: log_softmax of the same bf16 matmul in float32. Tolerances: values 1e-4 absolute; gradients
    (bf16 matmuls) 2e-2 relative to their largest entry."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, hidden, vocab = 1000, 256, 151_936
    h = (torch.randn(rows, hidden, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(vocab + 64, hidden, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    t = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    g_logp, g_ent = (
        torch.randn(rows, device="cuda", generator=g),
        torch.randn(rows, device="cuda", generator=g),
    )
    logp, ent = linear_log_probs(h, w, t, temperature=0.9, vocab_size=vocab, rows_per_chunk=400)
    gh, gw = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (h, w))
    z = (h @ w.t()).float()[:, :vocab] / 0.9
    ls = z.log_softmax(-1)
    ref_logp, ref_ent = ls.gather(1, t[:, None])[:, 0], -(ls.exp() * ls).sum(-1)
    rgh, rgw = torch.autograd.grad((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum(), (h, w))
    assert (logp - ref_logp).abs().max() < 1e-4 and (ent - ref_ent).abs().max() < 1e-4
    for a, b in ((gh, rgh), (gw, rgw)):
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()) < 2e-2
    # the one-pass head (the loss's gradient in the forward, float32 main_grad as megatron DDP's), same kernels
    w1 = w.detach().clone().requires_grad_()
    w1.main_grad = torch.zeros(w1.shape, dtype=torch.float32, device="cuda")
    h1 = h.detach().clone().requires_grad_()
    anchor, logp1, ent1 = linear_log_probs_one_pass(
        h1,
        w1,
        t,
        lambda rows, lp, e: (g_logp[rows], g_ent[rows]),
        temperature=0.9,
        vocab_size=vocab,
        rows_per_chunk=400,
    )
    anchor.backward()
    assert torch.equal(logp1, logp.detach()) and torch.equal(ent1, ent.detach())
    for a, b in ((h1.grad, rgh), (w1.main_grad, rgw)):
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_chunks_stay_within_their_memory_budget():
    """On the Triton path a chunk holds its bf16 logits and their bf16 gradient (4 bytes per logit), so the
    default chunks are sized for that: the peak memory of the one-pass head and of the two-pass head's
    forward and backward over 3 default chunks at Qwen's vocabulary stays within the budget plus the
    inputs' and outputs' own sizes (the weight's float32 main_grad, the hidden rows' gradient)."""
    vocab, hidden = 151_936, 896
    w = torch.randn(vocab, hidden, device="cuda").bfloat16().requires_grad_()
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
    rows = _default_chunk_rows(w, torch.empty(1, hidden, device="cuda", dtype=torch.bfloat16))
    assert rows == chunk_rows(vocab, bytes_per_logit=TRITON_BYTES_PER_LOGIT)
    h = torch.randn(3 * rows, hidden, device="cuda").bfloat16().requires_grad_()
    t = torch.randint(0, vocab, (3 * rows,), device="cuda")
    ones = torch.ones(3 * rows, device="cuda")
    slack = 128 << 20  # per-row float32 vectors, one chunk's (rows, hidden) product, the GEMMs' workspaces
    for one_pass in (False, True):
        h.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if one_pass:
            anchor, _, _ = linear_log_probs_one_pass(
                h, w, t, lambda r, lp, e: (ones[r], ones[r]), vocab_size=vocab
            )
            anchor.backward()
        else:
            logp, ent = linear_log_probs(h, w, t, vocab_size=vocab)
            (logp.sum() + ent.sum()).backward()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= CHUNK_BYTES + h.numel() * 2 + slack, (one_pass, peak / 2**30)


@pytest.mark.parametrize("rows_per_chunk", [4, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("main_grad", [False, True])
def test_one_pass_gradients_match_full_logits(rows_per_chunk, temperature, main_grad):
    """`linear_log_probs_one_pass` with a token-local loss (sum of a(t) tanh(logp) + b(t) ent^2: its per-token
    gradient depends on the token's own values) against autograd through the full logits: values, the
    anchor's gradients of hidden and weight (into `main_grad` when the weight has one), scaled by grad_scale."""
    h, w, t, a, b = inputs(5)
    scale = 3.0

    def loss_of(logp, ent):
        return (a * logp.tanh() + b * ent.square()).sum()

    def token_grads(rows, logp, ent):
        return a[rows] / logp.double().cosh().square(), 2 * b[rows] * ent.double()

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    if main_grad:
        ww.main_grad = torch.full_like(w, 0.25)
    anchor, logp, ent = linear_log_probs_one_pass(
        hh,
        ww,
        t,
        token_grads,
        grad_scale=scale,
        temperature=temperature,
        vocab_size=VOCAB,
        rows_per_chunk=rows_per_chunk,
    )
    assert not logp.requires_grad and not ent.requires_grad and anchor.item() == 0
    (loss_of(logp, ent) + anchor).backward(torch.tensor(scale))
    rh, rw = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_logp, ref_ent = reference(rh, rw, t, temperature)
    (scale * loss_of(ref_logp, ref_ent)).backward()
    gw = ww.main_grad - 0.25 if main_grad else ww.grad
    assert not main_grad or ww.grad is None
    for name, x, ref in (
        ("logp", logp, ref_logp),
        ("ent", ent, ref_ent),
        ("h", hh.grad, rh.grad),
        ("w", gw, rw.grad),
    ):
        assert torch.allclose(x.double(), ref.detach(), atol=1e-5, rtol=1e-5), (
            f"{name}: {(x - ref).abs().max()}"
        )


def test_one_pass_backward_runs_no_matmul():
    """The one-pass head's three GEMMs per chunk (logits, dh, dW) all run in the forward; its backward hands
    back what the forward computed: no logits are recomputed (the two-pass head's backward runs three)."""
    h, w, t, _, _ = inputs(6)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    gemm = 2 * N * H * V
    with FlopCounterMode(display=False) as forward:
        anchor, _, _ = linear_log_probs_one_pass(
            hh, ww, t, lambda rows, lp, e: (torch.ones_like(lp), e), vocab_size=VOCAB, rows_per_chunk=4
        )
    with FlopCounterMode(display=False) as backward:
        anchor.backward()
    assert forward.get_total_flops() == 3 * gemm and backward.get_total_flops() == 0
    logp, ent = linear_log_probs(hh, ww, t, vocab_size=VOCAB, rows_per_chunk=4)
    with FlopCounterMode(display=False) as two_pass:
        (logp.sum() + (ent * ent.detach()).sum()).backward()
    assert two_pass.get_total_flops() == 3 * gemm
