"""The transformer layer spec the engine builds every GPTModel with: megatron-core's local spec with two
modules swapped in.

- `SDPAAttention` replaces megatron's local `DotProductAttention` (unfused softmax): PyTorch's
  `scaled_dot_product_attention` picks flash/cuDNN kernels on GPU (measured 35.5% -> 49.8% MFU at 1.5B,
  ../shared/notes/performance-anchors.md) and runs everywhere else too. Causal only: the engine lays every
  sequence out right-padded from position 0, so a causal mask is exact for the valid tokens and no padding
  mask is needed.
- `RMSNorm` replaces `WrappedTorchNorm`, which refuses sequence parallelism; ours tags its weight
  `sequence_parallel` so megatron all-reduces its gradient across the TP group when SP is on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPAAttention(MegatronModule):
    """Core attention: q (sq, b, heads, dim), k/v (sk, b, groups, dim) -> (sq, b, heads * dim), causal."""

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
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAAttention: attention_bias and packed sequences are not supported")
        q = query.permute(1, 2, 0, 3)  # (b, heads, sq, dim)
        k = key.permute(1, 2, 0, 3)  # (b, groups, sk, dim)
        v = value.permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # (b, heads, sq, dim)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in float32 like Hugging Face's Llama/Qwen norms, weight tagged for SP."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def layer_spec(qk_norm: bool) -> ModuleSpec:
    """megatron's local GPT layer spec (RMSNorm, optional QK-norm) with SDPA attention and our RMSNorm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    attn = sub.self_attention.submodules
    attn.core_attention = SDPAAttention
    if qk_norm:
        attn.q_layernorm = RMSNorm
        attn.k_layernorm = RMSNorm
    return spec
