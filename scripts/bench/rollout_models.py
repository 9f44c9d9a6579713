"""The rollout benches' models: a preset's shape (conf/model/<preset>.yaml; the tiny CPU presets with a
512-token vocabulary in float32) and random weights directly in the rollout layout at TP=1 (scripts/bench/
rollout.py, decode_phases.py, decode_overlap.py, multi_turn.py)."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
from omegaconf import OmegaConf

from engine.config import ModelConfig
from engine.models.builder import ModelShape, resolve_shape
from parallel.rollout_weights import RolloutWeights

CONF_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "conf", "model")
PRESETS = ("tiny", "tiny_moe", "qwen2_5_0_5b", "qwen2_5_1_5b", "qwen2_5_7b", "qwen1_5_moe_a2_7b")
TINY = ("tiny", "tiny_moe")
TINY_VOCAB = 512


def model_shape(preset: str) -> ModelShape:
    m = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(os.path.join(CONF_MODEL, f"{preset}.yaml"))
    )
    m = OmegaConf.to_object(m)
    if preset in TINY:
        m = replace(m, vocab_size=TINY_VOCAB, dtype="float32")
    return resolve_shape(m, m.vocab_size, 1)


def _mlp_shapes(s: ModelShape, pre: str) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """Layer `pre`'s MLP tensors: (shapes of the single tensors, {prefix of expert e's name: (experts, ...)}
    for the routed experts, whose tensors are views of one tensor each)."""
    if s.moe is None:
        fc = {pre + "mlp.linear_fc1.weight": (2 * s.ffn_hidden_size, s.hidden_size)}
        return {**fc, pre + "mlp.linear_fc2.weight": (s.hidden_size, s.ffn_hidden_size)}, {}
    m, mlp = s.moe, pre + "mlp."
    single = {mlp + "router.weight": (m.num_experts, s.hidden_size)}
    if m.shared_ffn_hidden_size:
        single[mlp + "shared_experts.linear_fc1.weight"] = (2 * m.shared_ffn_hidden_size, s.hidden_size)
        single[mlp + "shared_experts.linear_fc2.weight"] = (s.hidden_size, m.shared_ffn_hidden_size)
    if m.shared_gate:
        single[mlp + "shared_experts.gate_weight"] = (1, s.hidden_size)
    experts = mlp + "experts.local_experts.{}."
    stacked = {
        experts + "linear_fc1.weight": (m.num_experts, 2 * m.ffn_hidden_size, s.hidden_size),
        experts + "linear_fc2.weight": (m.num_experts, s.hidden_size, m.ffn_hidden_size),
    }
    return single, stacked


def random_rollout_weights(shape: ModelShape, device: torch.device, seed: int) -> RolloutWeights:
    """Every tensor of the rollout layout at TP=1 (names as engine/rollout/model.py reads them), N(0, 0.02)
    matrices and unit norms; an MoE layer's routed experts are the slices of one (experts, ...) tensor per
    weight."""
    s, hd = shape, shape.head_dim
    stacked = {}
    qkv_rows = (s.num_attention_heads + 2 * s.num_query_groups) * hd
    shapes = {"embedding.word_embeddings.weight": (s.padded_vocab_size, s.hidden_size)}
    for i in range(s.num_layers):
        pre, att = f"decoder.layers.{i}.", f"decoder.layers.{i}.self_attention."
        shapes[pre + "input_layernorm.weight"] = (s.hidden_size,)
        shapes[att + "linear_qkv.weight"] = (qkv_rows, s.hidden_size)
        if s.qkv_bias:
            shapes[att + "linear_qkv.bias"] = (qkv_rows,)
        if s.qk_norm:
            shapes[att + "q_layernorm.weight"] = shapes[att + "k_layernorm.weight"] = (hd,)
        shapes[att + "linear_proj.weight"] = (s.hidden_size, s.num_attention_heads * hd)
        shapes[pre + "pre_mlp_layernorm.weight"] = (s.hidden_size,)
        single, per_expert = _mlp_shapes(s, pre)
        shapes.update(single)
        stacked.update(per_expert)
    shapes["decoder.final_layernorm.weight"] = (s.hidden_size,)
    if not s.tie_embeddings:
        shapes["output_layer.weight"] = (s.padded_vocab_size, s.hidden_size)
    gen = torch.Generator(device=device).manual_seed(seed)
    params = {}
    for name, size in shapes.items():
        if len(size) == 1 and "bias" not in name:
            params[name] = torch.ones(size, dtype=s.dtype, device=device)
        else:
            params[name] = (torch.randn(size, generator=gen, device=device) * 0.02).to(s.dtype)
    for name, size in stacked.items():
        whole = torch.empty(size, dtype=s.dtype, device=device)
        for e in range(size[0]):
            whole[e] = torch.randn(size[1:], generator=gen, device=device) * 0.02
            params[name.format(e)] = whole[e]
    return RolloutWeights(params, 1, 0, None, None, 0, 1)
