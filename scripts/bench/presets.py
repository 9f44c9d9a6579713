"""Architecture presets of the benchmarks, read from conf/model/<name>.yaml, as HF config kwargs."""

from __future__ import annotations

import os

import yaml

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf", "model")


def model_preset(name: str) -> dict:
    with open(os.path.join(CONF, f"{name}.yaml")) as f:
        return yaml.safe_load(f)


def attention_dims(name: str) -> tuple[int, int, int, int]:
    """(query heads, key/value groups, head dim, layers) of a preset."""
    m = model_preset(name)
    heads = m["num_attention_heads"]
    return heads, m["num_query_groups"], m.get("head_dim") or m["hidden_size"] // heads, m["num_layers"]


def model_config(name: str, **overrides):
    """conf/model/<name>.yaml as the engine's typed `ModelConfig`, with fields replaced by `overrides`."""
    from dataclasses import replace

    from omegaconf import OmegaConf

    from engine.config import ModelConfig

    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.create(model_preset(name)))
    return replace(OmegaConf.to_object(merged), **overrides)


def hf_config_for(name: str) -> dict:
    """Qwen2Config kwargs for a conf/model preset (random init; used by the TRL, verl and transformers baselines).
    A preset without `vocab_size` (tiny: the engine takes the embedded tokenizer's) gets 64 (> its 50 tokens)."""
    m = model_preset(name)
    heads = m["num_attention_heads"]
    return dict(
        vocab_size=m.get("vocab_size", 64),
        hidden_size=m["hidden_size"],
        intermediate_size=m["ffn_hidden_size"],
        num_hidden_layers=m["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=m["num_query_groups"],
        head_dim=m.get("head_dim") or m["hidden_size"] // heads,
        max_position_embeddings=m["max_position_embeddings"],
        rope_theta=m.get("rope_theta", 10000.0),
        rms_norm_eps=m.get("norm_eps", 1e-6),
        tie_word_embeddings=m.get("tie_embeddings", False),
        use_sliding_window=False,
    )


def num_params(name: str) -> int:
    """Parameters of the architecture (embedding counted once when tied)."""
    m = model_preset(name)
    h, f, L, v = m["hidden_size"], m["ffn_hidden_size"], m["num_layers"], m.get("vocab_size", 50)
    hd = m.get("head_dim") or h // m["num_attention_heads"]
    q, kv = m["num_attention_heads"] * hd, m["num_query_groups"] * hd
    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if m.get("qkv_bias") else 0)
    layer = attn + 3 * h * f + 2 * h
    emb = v * h * (1 if m.get("tie_embeddings") else 2)
    return L * layer + emb + h
