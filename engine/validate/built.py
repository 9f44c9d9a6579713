"""The model a run builds, for the checks that read its architecture: `cfg.model`, or with model.path set the
architecture of the checkpoint's config.json (engine/models/hf_config.py `checkpoint_model_config`, as
engine/setup.py `model_shape` builds it). `model_key` names a value in messages by where it came from."""

from __future__ import annotations

import os

from engine.config import ModelConfig, TrainConfig
from engine.models.hf_config import HF_CONFIG_FILE, MOE_TRAINING_KEYS, checkpoint_model_config

# config.json's names for the model.* fields whose names differ there; the rest are spelt alike.
HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_query_groups": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size",
    "moe.ffn_hidden_size": "moe_intermediate_size",
    "moe.top_k": "num_experts_per_tok",
    "moe.shared_expert_ffn_hidden_size": "shared_expert_intermediate_size",
    "moe.aux_loss_coef": "router_aux_loss_coef",
}


def built_model(cfg: TrainConfig) -> ModelConfig:
    """The ModelConfig the run builds: model.path's config.json architecture when set, else `cfg.model`.
    Reads the JSON file only; a config.json the engine cannot load raises `HFCheckpointError`."""
    return checkpoint_model_config(cfg.model) if cfg.model.path else cfg.model


def model_key(cfg: TrainConfig, field: str) -> str:
    """How messages name the built model's `field` ("num_layers", "moe.num_experts"): model.<field>, or the
    key of model.path's config.json that sets it (model.moe.aux_loss_coef, once set, overrides the file's)."""
    overridden = field == "moe.aux_loss_coef" and cfg.model.moe.aux_loss_coef is not None
    if not cfg.model.path or field.removeprefix("moe.") in MOE_TRAINING_KEYS or overridden:
        return f"model.{field}"
    name = HF_NAMES.get(field, field.removeprefix("moe."))
    return f"model.path's {os.path.join(cfg.model.path, HF_CONFIG_FILE)}: {name}"
