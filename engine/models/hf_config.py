"""Read a Hugging Face checkpoint's config.json into `ModelConfig` field overrides.

Supported: the Qwen2/Qwen2.5 (QKV bias), Qwen3 (QK-norm) and Llama (3.x RoPE scaling included) families,
and the mixture-of-experts Qwen3-MoE and Qwen2-MoE (every layer sparse; softmax router; Qwen2-MoE's gated
shared expert), as causal LMs or with a token/sequence classification head (`score.weight`, a critic or reward model).
Anything the engine's GPTModel cannot represent exactly (sliding-window attention, biases other than
Qwen2's QKV bias, activations other than SiLU, other RoPE scalings) is refused with an error naming the
key, rather than loaded into a model that silently computes something else.

Reads JSON only: no transformers import, no weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.errors import UserError

if TYPE_CHECKING:
    import torch

    from engine.config import ModelConfig, MoEConfig
    from engine.models.builder import ModelShape

HF_CONFIG_FILE = "config.json"
# model.moe fields config.json does not hold (training settings): a checkpoint's model keeps the config's.
MOE_TRAINING_KEYS = ("z_loss_coef", "token_dispatcher")
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe")
_FAMILIES = {
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "llama": "Llama",
    "qwen3_moe": "Qwen3Moe",
    "qwen2_moe": "Qwen2Moe",
}
SUPPORTED_HEADS = ("ForCausalLM", "ForTokenClassification", "ForSequenceClassification")

# megatron's RotaryEmbedding._apply_scaling fixes everything of Llama-3 scaling but the factor.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class HFCheckpointError(UserError, ValueError):
    """A Hugging Face checkpoint the engine cannot load; the message names the file, key or tensor and a fix."""


def read_hf_config(path: str) -> dict[str, Any]:
    """The parsed config.json of the checkpoint directory `path`."""
    if not os.path.isdir(path):
        raise HFCheckpointError(
            f"model.path={path!r} is not a directory; point it at a local Hugging Face checkpoint "
            f"directory (with {HF_CONFIG_FILE} and *.safetensors)"
        )
    file = os.path.join(path, HF_CONFIG_FILE)
    if not os.path.isfile(file):
        raise HFCheckpointError(
            f"{file} is missing; a Hugging Face checkpoint directory needs its {HF_CONFIG_FILE} "
            f"(save the model with save_pretrained, or copy config.json next to the weights)"
        )
    with open(file) as f:
        return json.load(f)


def _model_type(cfg: dict[str, Any], file: str) -> str:
    model_type = cfg.get("model_type")
    architectures = cfg.get("architectures") or []
    supported = [t + h for t in _FAMILIES.values() for h in SUPPORTED_HEADS]
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFCheckpointError(
            f"{file}: model_type={model_type!r} (architectures={architectures}) is not supported; "
            f"supported model_type values: {', '.join(SUPPORTED_MODEL_TYPES)} "
            f"(architectures {', '.join(supported)})"
        )
    for arch in architectures:
        if not any(arch.endswith(h) for h in SUPPORTED_HEADS):
            raise HFCheckpointError(
                f"{file}: architectures={architectures} has {arch!r}, whose head is not supported; "
                f"supported architectures: {', '.join(supported)}"
            )
    return model_type


def _refuse(file: str, key: str, value: Any, why: str) -> None:
    raise HFCheckpointError(f"{file}: {key}={value!r} is not supported: {why}")


def _rope(cfg: dict[str, Any], file: str) -> tuple[float, float]:
    """(rope_theta, llama3 scaling factor or 0) from either config layout.

    transformers >= 5 writes `rope_parameters` (theta inside); older configs have top-level `rope_theta`
    and an optional `rope_scaling`. Where both are present (a transformers-5 config edited as model cards
    say, e.g. a `rope_scaling` yarn block added for long context), `rope_scaling` wins key by key, as in
    transformers: reading `rope_parameters` alone would run default RoPE where transformers scales.
    """
    scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling:  # the older spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    params = {**(cfg.get("rope_parameters") or {}), **scaling}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))  # 10000: HF's default
    if theta != int(theta):
        _refuse(file, "rope_theta", theta, "megatron's GPTModel takes an integer rotary base")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, 0.0
    if rope_type != "llama3":
        _refuse(file, "rope_type", rope_type, "only 'default' and 'llama3' RoPE are implemented")
    for key, want in _MEGATRON_LLAMA3_ROPE.items():
        if float(params.get(key, -1)) != want:
            _refuse(
                file,
                f"rope {key}",
                params.get(key),
                f"megatron's Llama-3 RoPE scaling fixes {key}={want} (only the factor is configurable)",
            )
    return theta, float(params["factor"])


def _check_unsupported(cfg: dict[str, Any], model_type: str, file: str) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse(file, "hidden_act", cfg["hidden_act"], "the engine's MLP is SwiGLU (silu)")
    if cfg.get("use_sliding_window"):
        _refuse(file, "use_sliding_window", True, "the engine's attention is full causal attention")
    layer_types = set(cfg.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        _refuse(file, "layer_types", sorted(layer_types), "only full_attention layers are implemented")
    if model_type not in ("qwen2", "qwen2_moe") and cfg.get("attention_bias"):
        _refuse(file, "attention_bias", True, "biases on q/k/v/o projections are Qwen2-only (q/k/v)")
    if cfg.get("mlp_bias"):
        _refuse(file, "mlp_bias", True, "the engine's MLP has no bias")


def _moe(cfg: dict[str, Any], model_type: str, file: str) -> MoEConfig:
    """model.moe from a Qwen3-MoE / Qwen2-MoE config.json (the default, dense, for other families)."""
    from engine.config import MoEConfig

    if not model_type.endswith("_moe"):
        return MoEConfig()
    if int(cfg.get("decoder_sparse_step", 1)) != 1:
        _refuse(file, "decoder_sparse_step", cfg["decoder_sparse_step"], "every layer must be an MoE layer")
    if cfg.get("mlp_only_layers"):
        _refuse(file, "mlp_only_layers", cfg["mlp_only_layers"], "every layer must be an MoE layer")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    try:
        return MoEConfig(
            num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            ffn_hidden_size=int(cfg["moe_intermediate_size"]),
            shared_expert_ffn_hidden_size=shared,
            shared_expert_gate=shared > 0,  # Qwen2-MoE always gates its shared expert
            score_function="softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
        )
    except KeyError as err:
        raise HFCheckpointError(f"{file}: key {err.args[0]!r} is missing; the file looks truncated") from None


def model_config_from_hf(path: str) -> dict[str, Any]:
    """ModelConfig field overrides describing the checkpoint at `path` (config.json only).

    Keys: num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, head_dim,
    vocab_size, max_position_embeddings, rope_theta, rope_scaling_factor, norm_eps, qkv_bias, qk_norm,
    tie_embeddings, moe (a `MoEConfig`; 0 experts for dense families). The compute dtype is left to the caller (`model.dtype`).
    """
    cfg = read_hf_config(path)
    file = os.path.join(path, HF_CONFIG_FILE)
    model_type = _model_type(cfg, file)
    _check_unsupported(cfg, model_type, file)
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        overrides = {
            "num_layers": int(cfg["num_hidden_layers"]),
            "hidden_size": hidden,
            "ffn_hidden_size": int(cfg["intermediate_size"]),
            "num_attention_heads": heads,
            "num_query_groups": int(cfg.get("num_key_value_heads") or heads),  # absent = multi-head
            "head_dim": int(cfg.get("head_dim") or hidden // heads),
            "vocab_size": int(cfg["vocab_size"]),
            "max_position_embeddings": int(cfg["max_position_embeddings"]),
            "norm_eps": float(cfg["rms_norm_eps"]),
        }
    except KeyError as err:
        raise HFCheckpointError(f"{file}: key {err.args[0]!r} is missing; the file looks truncated") from None
    theta, factor = _rope(cfg, file)
    overrides.update(
        rope_theta=theta,
        rope_scaling_factor=factor,
        # Qwen2 modeling code hard-codes bias=True on q/k/v; Qwen2-MoE's `qkv_bias` defaults to true
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True))),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        moe=_moe(cfg, model_type, file),
    )
    return overrides


def checkpoint_model_config(model: ModelConfig) -> ModelConfig:
    """`model` with the architecture of the checkpoint at `model.path` (`model_config_from_hf`): what a run
    with model.path builds. What config.json does not hold stays the config's: dtype, recompute, init_std,
    the tokenizer, model.moe's `MOE_TRAINING_KEYS`, and model.moe.aux_loss_coef where it is set (None: the
    checkpoint's `router_aux_loss_coef`)."""
    overrides = model_config_from_hf(model.path)
    overrides["moe"] = replace(overrides["moe"], **{k: getattr(model.moe, k) for k in MOE_TRAINING_KEYS})
    if model.moe.aux_loss_coef is not None and overrides["moe"].num_experts:
        overrides["moe"] = replace(overrides["moe"], aux_loss_coef=model.moe.aux_loss_coef)
    return replace(model, **overrides)


def hf_config_from_shape(
    shape: ModelShape,
    special_token_ids: Mapping[str, int | None] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """A transformers config.json for a randomly initialised model: Qwen2 when it has a QKV bias (Qwen2's
    modeling code hard-codes it), Qwen3 when it has QK-norm, else Llama (which takes any head_dim, tied or
    untied embeddings and Llama-3 RoPE scaling); an MoE model as Qwen3-MoE or Qwen2-MoE (`_moe_model_type`). RoPE in the layout both transformers 4 and 5 read."""
    if shape.qkv_bias and shape.qk_norm:
        raise ValueError("no Hugging Face family has both a QKV bias and QK-norm; cannot write a config.json")
    model_type = "qwen2" if shape.qkv_bias else "qwen3" if shape.qk_norm else "llama"
    if shape.moe is not None:
        model_type = _moe_model_type(shape)
    arch = _FAMILIES[model_type] + "ForCausalLM"
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype or shape.dtype).removeprefix("torch."),
        **{k: v for k, v in (special_token_ids or {}).items() if v is not None},
    }
    if model_type != "llama":
        cfg["use_sliding_window"] = False
    if shape.moe is not None:
        cfg.update(_moe_hf_fields(shape))
    if shape.rope_scaling_factor:
        cfg["rope_scaling"] = {  # megatron's Llama-3 scaling: only the factor is configurable
            "rope_type": "llama3",
            "factor": shape.rope_scaling_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return cfg


def _moe_model_type(shape: ModelShape) -> str:
    moe = shape.moe
    return moe_model_type(
        shape.qkv_bias, shape.qk_norm, moe.score_function, moe.shared_ffn_hidden_size, moe.shared_gate
    )


def moe_model_type(
    qkv_bias: bool, qk_norm: bool, score_function: str, shared_ffn_hidden_size: int, shared_gate: bool
) -> str:
    """qwen3_moe (QK-norm, no shared expert) or qwen2_moe (gated shared expert): the Hugging Face family that
    computes what this MoE architecture does, or a ValueError naming the keys that differ."""
    if score_function != "softmax":
        raise ValueError(f"no supported Hugging Face MoE family has a {score_function} router")
    if shared_ffn_hidden_size:
        if not shared_gate or qk_norm or not qkv_bias:
            raise ValueError(
                "a shared expert is written as Qwen2-MoE, which gates it and has a QKV bias and no QK-norm; "
                "this model differs (model.moe.shared_expert_gate, model.qkv_bias, model.qk_norm)"
            )
        return "qwen2_moe"
    if qkv_bias or not qk_norm:
        raise ValueError(
            "an MoE model without a shared expert is written as Qwen3-MoE, which has QK-norm and no QKV bias; "
            "this model differs (model.qk_norm, model.qkv_bias)"
        )
    return "qwen3_moe"


def _moe_hf_fields(shape: ModelShape) -> dict[str, Any]:
    moe = shape.moe
    fields = {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if moe.shared_ffn_hidden_size:
        fields["shared_expert_intermediate_size"] = moe.shared_ffn_hidden_size
        fields["qkv_bias"] = True
    return fields
