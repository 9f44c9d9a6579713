"""Packed micro-batches on CUDA (marked `gpu`, skipped on CPU).

- The trainer's packed micro-batches (FlashAttention-2 varlen for rows of different lengths) against padded
  micro-batches (SDPA) of the same rows, world size 1 (in-process, one GPU, NCCL). Tolerance, bfloat16 (2
  layers, hidden 256, 8 heads in 2 query groups, head dim 32): the two layouts run different attention kernels
  and round activations at different points, so log-probs and entropies differ by bfloat16 rounding, not by
  masking: within 5e-2 absolute (a masking error, e.g. a row attending to its neighbour, moves them by O(1)),
  parameter gradients and losses within 5e-2 of their scale.
- `packed_attention`'s CUDA paths alone (engine/models/packed_attention.py: FlashAttention-2 varlen with the
  key/value groups as they are; SDPA on views for rows of equal length), bf16, at Qwen2.5-1.5B's heads (12
  query heads in 2 groups, dim 128): output and q/k/v gradients against float32 attention row by row, each
  within 1.5x the largest error of torch's `varlen_attn` with the groups repeated per head (the path before)
  plus one bf16 ulp of the reference's scale.
- trainer.share_prompts (each group's prompt once, FlashAttention-2 with separate query and key boundaries)
  against packed whole rows, the same tolerances; at one shape, the split through cuDNN
  (engine/models/shared_prompt_split.py) against float32 within 2x the gathered layout's error.
- `padded_attention` (trainer.pack_sequences=false): no cuDNN kernel until its shape recurs, cuDNN from then
  on (the profiler's kernel names), both against float32 as above with SDPA's own choice as the path before.
"""

from __future__ import annotations

import pytest
import torch
from trainer_parity import packing_parity

from engine.models import packed_attention as packed_module

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
    calls = []
    flash = packed_module.FlashVarlen.apply

    def spy(*args):
        calls.append(args[0].shape)
        return flash(*args)

    monkeypatch.setattr(packed_module.FlashVarlen, "apply", spy)
    parity = packing_parity(MODEL, str(tmp_path), 64)
    assert calls, "the packed forward did not reach the varlen kernel"
    for key in ("log_probs", "entropy"):
        assert parity[key] <= 5e-2, parity
    for key in ("actor_grad_rel", "actor_loss_rel", "critic_grad_rel", "critic_loss_rel"):
        assert parity[key] <= 5e-2, parity
    assert parity["tokens_packed"] == parity["tokens_real"] < parity["tokens_padded"], parity


def test_shared_prompts_equal_packed_in_bfloat16(tmp_path, monkeypatch):
    """trainer.share_prompts on CUDA: responses attend to their prompt's one copy through FlashAttention-2
    varlen with separate query and key boundaries (causal aligned to the keys' end); against the same rows
    packed whole, the tolerances of the packed-vs-padded test above."""
    shared_calls = []
    flash = packed_module.FlashVarlen.apply

    def spy(*args):
        if len(args) > 6 and args[6] is not None:  # cu_seqlens_k: the shared-prompt layout
            shared_calls.append(args[0].shape)
        return flash(*args)

    monkeypatch.setattr(packed_module.FlashVarlen, "apply", spy)
    parity = packing_parity(MODEL, str(tmp_path), 64, shared=True)
    assert shared_calls, "the shared-prompt forward did not reach the varlen kernel"
    for key in ("log_probs", "entropy"):
        assert parity[key] <= 5e-2, parity
    for key in ("actor_grad_rel", "actor_loss_rel", "critic_grad_rel", "critic_loss_rel"):
        assert parity[key] <= 5e-2, parity
    assert parity["tokens_shared"] < parity["tokens_packed"], parity


def _errors(fn, q, k, v, grad, want) -> list[float]:
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    return [float((a.float() - b).abs().max()) for a, b in zip(got, want)]


@pytest.mark.parametrize("lengths", [[700, 13, 1, 256, 64], [512] * 6])
def test_packed_attention_kernels_match_float32(lengths, monkeypatch):
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.nn.attention.varlen import varlen_attn

    torch.manual_seed(0)
    t, heads, groups, dim, scale = sum(lengths), 12, 2, 128, 128**-0.5
    q, k, v, grad = (
        torch.randn(t, h, dim, device="cuda", dtype=torch.bfloat16) for h in (heads, groups, groups, heads)
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest = max(lengths)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
    ref = packed_module.segment_attention(qf, kf, vf, cu, cu, scale, 0.0)
    want = (ref.detach(), *torch.autograd.grad(ref, (qf, kf, vf), grad.float()))

    def before(q, k, v):  # torch >= 2.11's signature: causal as a window
        rk, rv = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
        return varlen_attn(q, rk, rv, cu, cu, longest, longest, scale=scale, window_size=(-1, 0))

    calls = []
    flash = packed_module.FlashVarlen.apply

    def spy(*args):
        calls.append(1)
        return flash(*args)

    monkeypatch.setattr(packed_module.FlashVarlen, "apply", spy)
    monkeypatch.setattr(packed_module, "RECURRING", packed_module.RecurringShapes())
    monkeypatch.setattr(packed_module, "CUDNN_FROM_CALL", 2)
    old = _errors(before, q, k, v, grad, want)
    uniform = len(set(lengths)) == 1
    # rows of different lengths: flash every call; equal rows: flash on the shape's first call, SDPA from its 2nd
    for call, flash_expected in enumerate((True, not uniform)):
        got = _errors(
            lambda q, k, v: packed_module.packed_attention(q, k, v, params, scale), q, k, v, grad, want
        )
        assert len(calls) == flash_expected, (call, calls)
        del calls[:]
        for name, g, o, w in zip(("out", "dq", "dk", "dv"), got, old, want):
            ulp = float(w.abs().max()) * 2**-8
            assert g <= 1.5 * o + ulp, (name, g, o, lengths, call)


def _cuda_kernels(fn) -> list[str]:
    """Names of the CUDA kernels `fn` launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key.lower() for e in prof.key_averages() if e.device_type.name == "CUDA"]


def test_padded_attention_takes_cudnn_only_for_a_recurring_shape(monkeypatch):
    """A padded micro-batch's attention runs without cuDNN on its shape's first call and with it from the
    CUDNN_FROM_CALL-th (2 here) on; both within 1.5x SDPA's own choice's error (plus one bf16 ulp) against
    float32, output and q/k/v gradients, at 1.5B's heads."""
    torch.manual_seed(0)
    b, s, heads, groups, dim, scale = 3, 300, 12, 2, 128, 128**-0.5
    q, k, v, grad = (
        torch.randn(b, h, s, dim, device="cuda", dtype=torch.bfloat16) for h in (heads, groups, groups, heads)
    )
    qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
    ref = packed_module.causal_sdpa(qf, kf, vf, scale, 0.0)
    want = (ref.detach(), *torch.autograd.grad(ref, (qf, kf, vf), grad.float()))
    old = _errors(lambda q, k, v: packed_module.causal_sdpa(q, k, v, scale, 0.0), q, k, v, grad, want)
    monkeypatch.setattr(packed_module, "RECURRING", packed_module.RecurringShapes())
    monkeypatch.setattr(packed_module, "CUDNN_FROM_CALL", 2)
    padded = lambda q, k, v: packed_module.padded_attention(q, k, v, scale, 0.0)  # noqa: E731
    for call, cudnn in enumerate((False, True)):
        got: list[float] = []
        kernels = _cuda_kernels(lambda errors=got: errors.extend(_errors(padded, q, k, v, grad, want)))
        assert any("cudnn" in n for n in kernels) == cudnn, (call, kernels)
        assert cudnn or any("flash" in n for n in kernels), (call, kernels)
        for name, g, o, w in zip(("out", "dq", "dk", "dv"), got, old, want):
            ulp = float(w.abs().max()) * 2**-8
            assert g <= 1.5 * o + ulp, (name, g, o, call)


def test_shared_split_runs_cudnn_within_the_gathered_error(monkeypatch):
    """trainer.share_prompts at one shape (a fixed-length step), at 1.5B's heads, 4 prompts of 256 tokens x 8
    responses of 512: both split kernels pass the device's check; `shared_prompt_attention` gathers the keys
    (FlashAttention-2) on the shape's first call and splits at the prompt as dense batches through cuDNN once
    it recurs (engine/models/shared_prompt_split.py; the profiler's kernel names), and output and q/k/v
    gradients against float32 are within 2x the gathered layout's FlashAttention-2 error plus one bf16 ulp of
    the reference's scale."""
    from test_shared_prompt_split import experience

    from engine.models import shared_prompt_attention as shared_module
    from engine.models import shared_prompt_split as split_module
    from engine.models.lse_kernels import CUDNN, FLASH_VARLEN
    from engine.roles.dynamic_batch import MicroBatcher

    exp = experience([256] * 4, [512] * 32, n=8)
    (mb,) = MicroBatcher(8, 1 << 20, 1, torch.device("cuda"), pack=True, share_prompts=True)(
        exp, torch.arange(32)
    )
    params, scale = mb["packed_seq_params"], 128**-0.5
    assert params.uniform == (4, 8, 256, 512)
    torch.manual_seed(0)
    t = mb["tokens"].shape[1]
    q, k, v, grad = (torch.randn(t, h, 128, device="cuda", dtype=torch.bfloat16) for h in (12, 2, 2, 12))
    idx = params.kv_index
    cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_k
    qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
    ref = packed_module.segment_attention(qf, kf[idx], vf[idx], cu_q, cu_k, scale, 0.0)
    want = (ref.detach(), *torch.autograd.grad(ref, (qf, kf, vf), grad.float()))

    def gathered(q, k, v):
        k_seg, v_seg = shared_module.GatherRows.apply(k, idx), shared_module.GatherRows.apply(v, idx)
        return packed_module.FlashVarlen.apply(q, k_seg, v_seg, cu_q, params.max_q, scale, cu_k, params.max_k)

    old = _errors(gathered, q, k, v, grad, want)
    split_module._AVAILABLE.clear()
    for kernel in (CUDNN, FLASH_VARLEN):
        assert split_module.split_available(q, k, v, kernel), f"{kernel} failed its check on this device"
    monkeypatch.setattr(packed_module, "RECURRING", packed_module.RecurringShapes())
    monkeypatch.setattr(shared_module, "RECURRING", packed_module.RECURRING)
    monkeypatch.setattr(packed_module, "CUDNN_FROM_CALL", 2)
    # the RoPE hook's mark (no model here); the micro-batch registered its positions
    shared_module.SHARED_POSITIONS.take(cu_q)
    attend = lambda q, k, v: shared_module.shared_prompt_attention(q, k, v, params, scale, 0.0)  # noqa: E731
    for call, split in enumerate((False, True)):
        got: list[float] = []
        kernels = _cuda_kernels(lambda errors=got: errors.extend(_errors(attend, q, k, v, grad, want)))
        assert any("cudnn" in n for n in kernels) == split, (call, kernels)
        assert any("flash" in n and "cudnn" not in n for n in kernels) != split, (call, kernels)
        for name, g, o, w in zip(("out", "dq", "dk", "dv"), got, old, want):
            ulp = float(w.abs().max()) * 2**-8
            assert g <= 2 * o + ulp, (name, g, o, call)


def test_varlen_split_within_the_gathered_error_on_long_tailed_rows():
    """The split through FlashAttention-2 varlen (engine/models/shared_prompt_split.py
    `varlen_split_attention`) on micro-batches the trainer cuts from long-tailed rows (prompts of 100 to 300
    tokens, responses of 1 to 1,500, 8 per prompt, padding to a multiple of 64), at 1.5B's heads: output and
    q/k/v gradients against float32 within 2x the gathered layout's error plus one bf16 ulp."""
    from test_shared_prompt_split import experience

    from engine.models import shared_prompt_attention as shared_module
    from engine.models.lse_kernels import FLASH_VARLEN
    from engine.models.shared_prompt_split import varlen_split_attention
    from engine.roles.dynamic_batch import MicroBatcher

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 301, (6,), generator=gen).tolist()
    exp = experience(prompts, torch.randint(1, 1501, (48,), generator=gen).tolist(), n=8)
    mbs = MicroBatcher(8, 12288, 64, torch.device("cuda"), pack=True, share_prompts=True)(
        exp, torch.arange(48)
    )
    assert len(mbs) > 1
    scale = 128**-0.5
    for i, mb in enumerate(mbs):
        p = mb["packed_seq_params"]
        assert p.cross is not None and p.uniform is None
        torch.manual_seed(i)
        t = mb["tokens"].shape[1]
        q, k, v, grad = (torch.randn(t, h, 128, device="cuda", dtype=torch.bfloat16) for h in (12, 2, 2, 12))
        idx, cu_q, cu_k = p.kv_index, p.cu_seqlens_q, p.cu_seqlens_k
        qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
        ref = packed_module.segment_attention(qf, kf[idx], vf[idx], cu_q, cu_k, scale, 0.0)
        want = (ref.detach(), *torch.autograd.grad(ref, (qf, kf, vf), grad.float()))

        def gathered(q, k, v, p=p):
            k_seg, v_seg = (
                shared_module.GatherRows.apply(k, p.kv_index),
                shared_module.GatherRows.apply(v, p.kv_index),
            )
            return packed_module.FlashVarlen.apply(
                q, k_seg, v_seg, p.cu_seqlens_q, p.max_q, scale, p.cu_seqlens_k, p.max_k
            )

        def split(q, k, v, p=p):
            return varlen_split_attention(q, k, v, p.cu_seqlens_q, p.max_q, p.cross, scale, FLASH_VARLEN)

        old = _errors(gathered, q, k, v, grad, want)
        got = _errors(split, q, k, v, grad, want)
        for name, g, o, w in zip(("out", "dq", "dk", "dv"), got, old, want):
            ulp = float(w.abs().max()) * 2**-8
            assert g <= 2 * o + ulp, (name, g, o, i)
