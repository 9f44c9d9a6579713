"""The fused kernels of the layer spec (engine/models/spec.py `Fusions`) against the op chains they replace.

World size: none for the kernel tests; 1 (in-process gloo, megatron's parallel state) for the whole-model test.
Tolerances, on CPU:
- RMSNorm (`F.rms_norm`, then the weight): bit-equal to the float32 chain, forward and backward, in float32 and
  bfloat16 (torch runs the same chain on CPU; on CUDA its fused kernel sums the mean in another order, which
  scripts/bench/update.py reports as `fusion_check`).
- RoPE, eager path (CPU): bit-equal to megatron's unfused `_apply_rotary_pos_emb_bshd`.
- RoPE, compiled (what CUDA runs; checked here with inductor's CPU backend): float32 within 1e-6 of eager;
  bfloat16 within 3 u (|t cos| + |rotate_half(t) sin|) per element, u = 2^-8 (eager rounds three times: two
  products and their sum; the kernel once; measured <= 2.2 u), and no less accurate than eager against float64.
- Whole model, fusions on vs off, same weights: logits and gradients bit-equal (float32 and bfloat16).
- Packed rows (thd): RoPE bit-equal to each row's sbhd RoPE from position 0 and to megatron's unfused thd
  path; row-wise attention (GQA) within 1e-6 of SDPA of each row alone (float32), forward and backward.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from engine.models import packed_attention as packed_module
from engine.models.packed_attention import packed_attention
from engine.models.spec import (
    Fusions,
    LastPackedPositions,
    RMSNorm,
    compiled_rope,
    fused_rope,
    fused_rope_thd,
    install_rope_fusion,
    rope_reference,
)


def _freqs(seq: int, rot_dim: int, theta: float = 1e6) -> torch.Tensor:
    """(seq, 1, 1, rot_dim) float32 angles, laid out as megatron's RotaryEmbedding returns them."""
    inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    x1, x2 = t.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fused_equals_float32_chain(dtype):
    config = SimpleNamespace(params_dtype=dtype, sequence_parallel=True)
    torch.manual_seed(0)
    ref, fused = RMSNorm(config, 1536, 1e-6, fused=False), RMSNorm(config, 1536, 1e-6, fused=True)
    assert fused.weight.sequence_parallel  # megatron all-reduces SP-tagged grads over TP
    weight = (torch.rand(1536) + 0.5).to(dtype)
    ref.weight.data.copy_(weight)
    fused.weight.data.copy_(weight)
    x = (torch.randn(48, 3, 1536) * 3).to(dtype).requires_grad_()
    grad = torch.randn(48, 3, 1536).to(dtype)
    y_ref, y = ref(x), fused(x)
    assert y.dtype == dtype and torch.equal(y, y_ref)
    for a, b in zip(
        torch.autograd.grad(y, (x, fused.weight), grad), torch.autograd.grad(y_ref, (x, ref.weight), grad)
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [128, 64])  # 64: partial rotary, the rest passes through
def test_rope_eager_path_equals_megatron_unfused(dtype, rot_dim):
    torch.manual_seed(0)
    t = torch.randn(16, 3, 4, 128).to(dtype)
    freqs = _freqs(16, rot_dim)
    want = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    assert torch.equal(rope_reference(t, freqs), want)
    assert torch.equal(fused_rope(t, freqs), want)  # CPU tensors take the eager path


def test_megatron_rope_fusion_flag_calls_our_kernel(monkeypatch):
    install_rope_fusion()
    assert rope_utils.fused_apply_rotary_pos_emb is fused_rope
    calls = []

    def spy(t, freqs, **kw):
        calls.append(t.shape)
        return fused_rope(t, freqs, **kw)

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", spy)
    config = SimpleNamespace(
        apply_rope_fusion=True, mrope_section=None, rotary_interleaved=False, multi_latent_attention=False
    )
    t, freqs = torch.randn(8, 2, 4, 64), _freqs(8, 64)
    out = rope_utils.apply_rotary_pos_emb(t, freqs, config, cp_group=object())
    assert calls == [t.shape] and torch.equal(out, rope_utils._apply_rotary_pos_emb_bshd(t, freqs))


def _packed(lengths: list[int], *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (sum(lengths), *shape) float32 rows and their int32 cu_seqlens."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(sum(lengths), *shape), cu


def test_equal_rows_go_to_cudnn_from_a_shapes_nth_call_where_flash_runs(monkeypatch):
    """Where FlashAttention-2 runs (stood in for here by SDPA over the rows), rows of equal length take the SDPA
    views (cuDNN on a GPU) only from their shape's CUDNN_FROM_CALL-th call; other shapes count apart."""
    from megatron.core.packed_seq_params import PackedSeqParams

    routes = []

    def flash(q, k, v, cu, longest, scale):
        routes.append("flash")
        return packed_module.segment_attention(q, k, v, cu, cu, scale, 0.0)

    def views(*args):
        routes.append("views")
        return uniform(*args)

    uniform = packed_module.uniform_rows_attention
    monkeypatch.setattr(packed_module, "flash_applies", lambda q, dropout_p: True)
    monkeypatch.setattr(packed_module.FlashVarlen, "apply", flash)
    monkeypatch.setattr(packed_module, "uniform_rows_attention", views)
    monkeypatch.setattr(packed_module, "RECURRING", packed_module.RecurringShapes())
    monkeypatch.setattr(packed_module, "CUDNN_FROM_CALL", 3)
    for lengths in ([4, 4], [4, 4], [4, 4], [4, 4], [3, 5], [3, 3, 3]):
        q, cu = _packed(lengths, 2, 8)
        m = max(lengths)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m
        )
        out = packed_attention(q, q[:, :1], q[:, :1], params, scale=0.5)
        want = packed_module.segment_attention(q, q[:, :1], q[:, :1], cu, cu, 0.5, 0.0)
        torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    assert routes == ["flash", "flash", "views", "views", "flash", "flash"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thd_rope_equals_per_row_rope(dtype, monkeypatch):
    torch.manual_seed(0)
    lengths = [7, 1, 30, 4]
    t, cu = _packed(lengths, 4, 64)
    t = t.to(dtype)
    freqs = _freqs(max(lengths), 64)
    got = fused_rope_thd(t, cu, freqs)
    want = torch.cat([rope_reference(row[:, None], freqs[: len(row)])[:, 0] for row in t.split(lengths)])
    assert got.dtype == dtype and torch.equal(got, want)
    # megatron's unfused thd path (apply_rope_fusion off) computes the same
    cp = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    assert torch.equal(got, rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=cp))
    # apply_rope_fusion routes packed rows (cu_seqlens given) through our thd hook
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    install_rope_fusion()
    assert rope_utils.fused_apply_rotary_pos_emb_thd is fused_rope_thd
    config = SimpleNamespace(
        apply_rope_fusion=True, mrope_section=None, rotary_interleaved=False, multi_latent_attention=False
    )
    assert torch.equal(rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=cp), got)


@pytest.mark.parametrize("groups_kv", [4, 2])  # 2: grouped-query attention
@pytest.mark.parametrize(
    "lengths", [[5, 17, 1, 9], [6, 6, 6], [5, 9, 5, 1, 5, 9]]
)  # the second: every row as long as the longest; the third: rows of one length batched
def test_packed_attention_equals_each_row_alone(groups_kv, lengths, monkeypatch):
    from megatron.core.packed_seq_params import PackedSeqParams

    uniform = len(set(lengths)) == 1
    if uniform:  # the equal-length path must be the one that runs: the segment path would fail here
        monkeypatch.setattr(packed_module, "segment_attention", None)
    torch.manual_seed(0)
    q, cu = _packed(lengths, 4, 16)
    k, _ = _packed(lengths, groups_kv, 16)
    v, _ = _packed(lengths, groups_kv, 16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    longest = max(lengths)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    out = packed_attention(q, k, v, params, scale=0.3)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    rows = []
    for qr, kr, vr in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        # one row alone in megatron's layout (s, b=1, heads, dim), repeated key/value groups, causal
        kr, vr = (x.repeat_interleave(4 // groups_kv, dim=1) for x in (kr, vr))
        o = torch.nn.functional.scaled_dot_product_attention(
            qr.transpose(0, 1)[None],
            kr.transpose(0, 1)[None],
            vr.transpose(0, 1)[None],
            is_causal=True,
            scale=0.3,
        )
        rows.append(o[0].transpose(0, 1))
    want = torch.cat(rows)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    for a, b in zip(got, torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")), reason="inductor's CPU backend needs a C++ compiler"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rope_matches_eager_within_rounding(dtype):
    torch.manual_seed(0)
    kernel = compiled_rope(dtype, grad=True)
    for seq, batch, heads in ((16, 3, 4), (20, 2, 2)):  # second shape: the recompile with dynamic shapes
        t = torch.randn(seq, batch, heads, 128).to(dtype).requires_grad_()
        freqs = _freqs(seq, 128)
        grad = torch.randn(seq, batch, heads, 128).to(dtype)
        eager = rope_reference(t, freqs)
        fused = kernel(t, freqs)
        (g_eager,) = torch.autograd.grad(eager, t, grad)
        (g_fused,) = torch.autograd.grad(fused, t, grad)
        assert fused.dtype == dtype and fused.shape == eager.shape
        t64, g64, f64 = t.detach().double(), grad.double(), freqs.double()
        exact = t64 * f64.cos() + _rotate_half(t64) * f64.sin()
        # backward of RoPE is the inverse rotation of the incoming gradient
        exact_grad = g64 * f64.cos() - _rotate_half(g64 * f64.sin())
        if dtype == torch.float32:
            torch.testing.assert_close(fused, eager, atol=1e-6, rtol=0)
            torch.testing.assert_close(g_fused, g_eager, atol=1e-6, rtol=0)
            continue
        scale = t64.abs() * f64.cos().abs() + _rotate_half(t64).abs() * f64.sin().abs()
        assert ((fused.double() - eager.double()).abs() <= 3 * 2**-8 * scale).all()
        g_scale = g64.abs() * f64.cos().abs() + _rotate_half(g64).abs() * f64.sin().abs()
        assert ((g_fused.double() - g_eager.double()).abs() <= 3 * 2**-8 * g_scale).all()
        assert (fused.double() - exact).abs().max() <= (eager.double() - exact).abs().max()
        assert (g_fused.double() - exact_grad).abs().max() <= (g_eager.double() - exact_grad).abs().max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_model_fusions_on_equals_off(groups, dtype, monkeypatch):
    from engine.config import ModelConfig
    from engine.models.builder import build_gpt_chunks, resolve_shape

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, qkv_bias=True, dtype=dtype)
    shape = resolve_shape(cfg, 48, 1)
    tokens = torch.randint(0, 48, (3, 10))
    positions = torch.arange(10).expand(3, 10)
    calls = []
    monkeypatch.setattr(  # count the calls megatron routes through its fused-RoPE hook
        rope_utils, "fused_apply_rotary_pos_emb", lambda t, f, **kw: calls.append(1) or fused_rope(t, f, **kw)
    )
    results = {}
    for name, fusions in (("off", Fusions(rms_norm=False, rope=False)), ("on", Fusions())):
        torch.manual_seed(11)
        (model,) = build_gpt_chunks(shape, groups, init_std=0.05, recompute=False, fusions=fusions)
        assert model.config.apply_rope_fusion == fusions.rope
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        assert len(norms) == 2 * 2 + 1 and all(n.fused == fusions.rms_norm for n in norms)
        calls.clear()
        logits = model(tokens, positions, None)
        logits.float().logsumexp(-1).mean().backward()
        assert len(calls) == (2 * 2 if fusions.rope else 0)  # q and k of each layer
        results[name] = (logits.detach(), {k: p.grad for k, p in model.named_parameters()})
    assert torch.equal(results["on"][0], results["off"][0])
    for key, grad in results["off"][1].items():
        assert torch.equal(results["on"][1][key], grad), key


def test_megatron_bias_dropout_add_compiles_to_one_add():
    """builder.py turns bias_dropout_fusion on for GPU; with no linear bias and hidden_dropout 0 megatron's
    torch.compile'd residual path must trace to an add (no dropout mask, no RNG): dropout(p=0) leaves a clone
    of the input, which inductor fuses into the add (its output code is one `fused_add` kernel), so the
    residual costs one elementwise pass. Checked on the forward graph AOTAutograd hands inductor."""
    from functorch.compile import make_boxed_func
    from megatron.core.fusions.fused_bias_dropout import _bias_dropout_add_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    fn = torch.compile(
        lambda x, residual: _bias_dropout_add_func((x, None), residual, 0.0, True),
        backend=aot_autograd(fw_compiler=capture),
    )
    x, residual = torch.randn(6, 2, 8, requires_grad=True), torch.randn(6, 2, 8, requires_grad=True)
    assert torch.equal(fn(x, residual), x + residual)
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert set(ops) <= {torch.ops.aten.clone.default, torch.ops.aten.add.Tensor}, ops
    assert ops.count(torch.ops.aten.add.Tensor) == 1, ops


def test_packed_positions_reused_for_the_same_unmodified_cu_seqlens_only():
    """The thd RoPE's positions are computed once per micro-batch (megatron passes every layer's query and key
    the same `cu_seqlens` tensor) and never reused for another tensor or an edited one."""
    cache = LastPackedPositions()
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    first = cache(cu, 9)
    assert torch.equal(first, torch.tensor([0, 1, 2, 0, 0, 1, 2, 3, 4]))
    assert cache(cu, 9) is first  # the same tensor, unmodified
    equal = cu.clone()
    assert cache(equal, 9) is not first and torch.equal(cache(equal, 9), first)  # another tensor
    before = cache(equal, 9)
    equal[1] = 2  # edited in place: its version changes
    edited = cache(equal, 9)
    assert edited is not before and torch.equal(edited, torch.tensor([0, 1, 0, 1, 0, 1, 2, 3, 4]))
    with torch.inference_mode():
        frozen = torch.tensor([0, 2, 5], dtype=torch.int32)
        assert torch.equal(cache(frozen, 5), torch.tensor([0, 1, 0, 1, 2]))  # no version counter: not cached
