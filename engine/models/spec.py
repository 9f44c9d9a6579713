"""The transformer layer spec the engine builds every GPTModel with: megatron-core's local spec with two
modules swapped in, and fused kernels where megatron's own need TransformerEngine or apex.

- `SDPAAttention` replaces megatron's local `DotProductAttention` (unfused softmax): PyTorch's
  `scaled_dot_product_attention` runs flash/cuDNN kernels on GPU (cuDNN only for shapes that recur, as its
  plan build per new shape costs more than it saves otherwise: engine/models/packed_attention.py) and runs
  everywhere else too. Causal only:
  the engine lays every sequence out right-padded from position 0, so a causal mask is exact for the valid
  tokens and no padding mask is needed. Packed micro-batches (rows back to back, megatron's thd
  `PackedSeqParams`) attend causally within each row (engine/models/packed_attention.py: SDPA on views where
  every row is as long as the longest, FlashAttention-2 varlen on CUDA in half precision, else SDPA with the
  rows of one length in one call);
  micro-batches that hold each group's prompt once (`SharedPromptSeqParams`, trainer.share_prompts) through
  engine/models/shared_prompt_attention.py, whose RoPE positions `fused_rope_thd` takes from it.
- `RMSNorm` replaces `WrappedTorchNorm`, which refuses sequence parallelism; ours tags its weight
  `sequence_parallel` so megatron all-reduces its gradient across the TP group when SP is on.
- `Fusions` selects the fused kernels (all on by default; off = the reference op chains, for benchmarks):
  RMSNorm with its weight as one Triton kernel each way on CUDA (torch's fused kernel elsewhere), and RoPE
  as one kernel each way through megatron's `apply_rope_fusion` hooks (sbhd, and thd for packed rows: angles
  gathered per token from its position in its row), which megatron otherwise fills from TransformerEngine only.
  The QKV projection's bias is added by its GEMM (engine/models/bias_epilogue.py).
  All compute the same math as the chains they replace (tests/engine/test_spec_fusions.py states the
  tolerances; the Triton kernels' parity: tests/engine/interpreted_triton.py, test_training_kernels.py).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from engine.models import triton_rms_norm, triton_rope
from engine.models.bias_epilogue import BiasInGemmColumnParallelLinear
from engine.models.packed_attention import packed_attention, padded_attention
from engine.models.shared_prompt_attention import (
    SHARED_POSITIONS,
    SharedPromptSeqParams,
    shared_prompt_attention,
)


@dataclass(frozen=True)
class Fusions:
    """Which fused kernels the layer spec uses; each replaces an op chain with the same math."""

    rms_norm: bool = True
    """RMSNorm and its weight as one Triton kernel each way on CUDA (engine/models/triton_rms_norm.py), elsewhere
    `F.rms_norm` then times the weight: float32 inside, the normalised row rounded once to the input dtype, then
    times the weight in the input dtype, as Hugging Face; off = the six-op float32 chain."""
    rope: bool = True
    """RoPE of q and k as one Triton kernel each way on CUDA (engine/models/triton_rope.py; compiled where it
    does not apply, eager on CPU), plugged into megatron's `apply_rope_fusion`; off = megatron's unfused RoPE
    (about five elementwise passes each way)."""
    wgrad: bool = True
    """On CUDA, the linear layers' weight gradients summed into the float32 `main_grad` by their GEMM
    (megatron's `gradient_accumulation_fusion`, engine/models/wgrad.py); off = a bf16 gradient, then a
    separate add (megatron's path without apex)."""
    qkv_bias: bool = True
    """The QKV projection's bias (Qwen-style models) added by its GEMM's epilogue
    (engine/models/bias_epilogue.py); off = megatron's GEMM, then a broadcast add."""


class SDPAAttention(MegatronModule):
    """Core attention, causal: q (sq, b, heads, dim), k/v (sk, b, groups, dim) -> (sq, b, heads * dim); with
    packed rows (`packed_seq_params`, thd) q (t, heads, dim), k/v (t, groups, dim) -> (t, heads * dim),
    causal within each row (`packed_attention`)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAAttention supports causal masks only, got {attn_mask_type}")
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise ValueError("SDPAAttention: attention_bias is not supported")
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"SDPAAttention: packed format {packed_seq_params.qkv_format!r}, not thd")
            attend = (
                shared_prompt_attention
                if isinstance(packed_seq_params, SharedPromptSeqParams)
                else packed_attention
            )
            out = attend(query, key, value, packed_seq_params, scale=self.softmax_scale, dropout_p=dropout_p)
            return out.reshape(out.shape[0], -1)
        q = query.permute(1, 2, 0, 3)  # (b, heads, sq, dim)
        k = key.permute(1, 2, 0, 3)  # (b, groups, sk, dim)
        v = value.permute(1, 2, 0, 3)
        out = padded_attention(q, k, v, self.softmax_scale, dropout_p)  # (b, heads, sq, dim)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def rms_normalize_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32, cast back to x's dtype: Hugging Face's Llama/Qwen norm without the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32.to(x.dtype)


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in float32 like Hugging Face's Llama/Qwen norms, weight tagged for SP.

    `fused` (Fusions.rms_norm) normalises with the Triton kernels of engine/models/triton_rms_norm.py (weight
    included, both ways) where they run, else torch's fused kernel, instead of the float32 op chain; the forward
    is the same up to the order of the mean's summation (bit-equal on CPU, where torch runs the same chain)."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, fused: bool = True, **unused
    ):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and triton_rms_norm.supported(x, self.weight):
            return triton_rms_norm.rms_norm(x, self.weight, self.eps)
        if self.fused:
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return self.weight * rms_normalize_reference(x, self.eps)


def rope_reference(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused RoPE (`_apply_rotary_pos_emb_bshd`, not interleaved, mscale 1) on t (s, b, heads,
    dim) with freqs (s, 1, 1, rot_dim) float32, op for op: products in t's dtype, rotate-half of the first
    rot_dim features, the rest passed through."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    x1, x2 = torch.chunk(t_rot, 2, dim=-1)
    out = t_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, t_pass), dim=-1)


_compiled_rope: dict[tuple[torch.dtype, bool], Callable] = {}


def compiled_rope(dtype: torch.dtype, grad: bool = False) -> Callable:
    """`rope_reference` compiled by torch.compile (one kernel forward, one backward) for inputs of `dtype`
    under grad mode `grad`, built on first use. Each (dtype, grad mode) compiles its own copy of the function:
    dynamo counts recompiles per code object (8 at most), and sequence lengths x batch sizes x query/key head
    counts x sbhd/thd layouts already take several, so one process that trains several dtypes, padded and
    packed, with and without grad, would run out on one shared copy. Sizes are marked dynamic by `fused_rope`
    (one kernel for every sequence length); past the limit dynamo runs the function eagerly (no fullgraph),
    the same math, never an error."""
    key = (dtype, grad)
    if key not in _compiled_rope:
        name = f"rope_reference_{str(dtype).removeprefix('torch.')}_{'grad' if grad else 'nograd'}"
        code = rope_reference.__code__.replace(co_name=name, co_qualname=name)
        _compiled_rope[key] = torch.compile(types.FunctionType(code, rope_reference.__globals__, name))
    return _compiled_rope[key]


def fused_rope(
    t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False, interleaved: bool = False
) -> torch.Tensor:
    """megatron's `fused_apply_rotary_pos_emb` contract (sbhd), without TransformerEngine: on CUDA the Triton
    kernel of engine/models/triton_rope.py (full-width rotation), else compiled; both compute in float32 and
    round once (the eager chain rounds after each product: <= 1 ulp apart); `rope_reference` elsewhere
    (bit-equal to megatron's unfused path)."""
    if interleaved:
        raise ValueError("fused_rope: interleaved RoPE is not supported (no Llama/Qwen model uses it)")
    if not t.is_cuda:
        return rope_reference(t, freqs)
    if triton_rope.supported(t, freqs):
        return triton_rope.rope(t, freqs)
    for x in (t, freqs):  # sequence length (and batch) vary per micro-batch: one dynamic kernel
        torch._dynamo.maybe_mark_dynamic(x, 0)
    return compiled_rope(t.dtype, torch.is_grad_enabled())(t, freqs)


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) position of each packed token within its row (0 at every row start), from `cu_seqlens`
    (rows + 1,) without a host sync."""
    starts = cu_seqlens[:-1].long()
    return torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(
        starts, cu_seqlens.diff(), output_size=total
    )


class LastPackedPositions:
    """`packed_positions` of the last `cu_seqlens` asked for, reused while it is the same tensor, unmodified.
    megatron calls the thd RoPE for the query and the key of every layer with the micro-batch's one
    `cu_seqlens` tensor, and the positions cost 80-130 us of host time per call (`repeat_interleave` with its
    output size; H200 hosts, scripts/bench/host_costs.py), 2 x layers times per micro-batch: at 1.5B, ~5 ms
    of a launch-bound micro-batch's ~150 ms. Inference tensors (no version counter) are not cached, nor
    positions computed while a CUDA graph is captured (engine/models/layer_graphs.py: each layer's graph
    computes its own, and a cached tensor would outlive the graph's memory)."""

    def __init__(self):
        self.last: tuple[weakref.ref, tuple[int, int], torch.Tensor] | None = None

    def __call__(self, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
        if cu_seqlens.is_inference() or (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
            return packed_positions(cu_seqlens, total)  # a CUDA graph computes its own (layer_graphs.py)
        key = (cu_seqlens._version, total)
        if self.last is not None and self.last[0]() is cu_seqlens and self.last[1] == key:
            return self.last[2]
        positions = packed_positions(cu_seqlens, total)
        self.last = (weakref.ref(cu_seqlens), key, positions)
        return positions


LAST_PACKED_POSITIONS = LastPackedPositions()


def fused_rope_thd(
    t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1, cp_rank: int = 0
) -> torch.Tensor:
    """megatron's `fused_apply_rotary_pos_emb_thd` contract without TransformerEngine: t (total, heads, dim)
    packed rows bounded by `cu_seqlens`, freqs (max_seqlen, 1, 1, rot_dim); each token rotated by the angles
    of its position in its row, through `fused_rope` (the same kernel as sbhd)."""
    if cp_size != 1:
        raise ValueError(f"fused_rope_thd: context parallelism is not supported (cp_size={cp_size})")
    positions = SHARED_POSITIONS.take(cu_seqlens)  # a shared-prompt micro-batch's own, else from the rows
    if positions is None:
        positions = LAST_PACKED_POSITIONS(cu_seqlens, t.shape[0])
    if t.is_cuda and triton_rope.supported(t, freqs):  # angles by position in the kernel: no gathered copy
        return triton_rope.rope(t[:, None], freqs, positions)[:, 0]
    return fused_rope(t[:, None], freqs[positions])[:, 0]


def install_rope_fusion() -> None:
    """Make megatron's `apply_rope_fusion=True` call `fused_rope` (sbhd) and `fused_rope_thd` (packed rows)
    when TransformerEngine's kernels are absent (megatron reads these hooks at call time; a TE kernel, when
    installed, is left in place). Idempotent."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = fused_rope_thd


def install_moe_without_te() -> None:
    """Let megatron's MoE router run without TransformerEngine: `moe_utils.RouterGatingLinearFunction` tests
    `te_general_gemm is not None`, a name megatron-core 0.16 binds only when TE imports; bound to None, the
    router takes its plain `torch.mm` path. Idempotent; a TE kernel, when installed, is left in place."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def layer_spec(qk_norm: bool, fusions: Fusions | None = None, num_experts: int | None = None) -> ModuleSpec:
    """megatron's local GPT layer spec (RMSNorm, optional QK-norm) with SDPA attention and our RMSNorm; with
    `num_experts`, megatron's local MoE MLP (top-k router, experts as a loop of SwiGLU MLPs
    (`SequentialMLP`), optional shared expert) in place of the dense MLP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    fusions = fusions or Fusions()
    norm = norm_spec(fusions)
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_norm, normalization="RMSNorm"
    )
    sub = spec.submodules
    sub.input_layernorm = norm
    sub.pre_mlp_layernorm = norm
    attn = sub.self_attention.submodules
    attn.core_attention = SDPAAttention
    if fusions.qkv_bias:
        attn.linear_qkv = BiasInGemmColumnParallelLinear
    if qk_norm:
        attn.q_layernorm = norm
        attn.k_layernorm = norm
    return spec


def norm_spec(fusions: Fusions) -> ModuleSpec:
    """Our RMSNorm, fused or not, as megatron builds it (final norm of the block and the layers' norms)."""
    return ModuleSpec(module=RMSNorm, params={"fused": fusions.rms_norm})
