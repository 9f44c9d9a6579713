"""Architecture keys that model.path's checkpoint replaces: one warning line for each whose configured value
differs from the checkpoint's, printed in the run header as the ignored-key warnings are.

With model.path set, the architecture comes from the checkpoint's config.json (engine/models/hf_config.py
`checkpoint_model_config`) and the model.* keys it holds are not read. `model=qwen2_5_1_5b
model.path=/ckpt/qwen2.5-0.5b` (a wrong preset or a wrong path) would otherwise train another model than the
one the preset names without a word.

Warnings, not errors. The checkpoint's weights fix the architecture, so the run is the one its config.json
describes, which is consistent in itself; the configured values could not be honoured by any fix short of
another checkpoint. A user may pick a preset deliberately for its dtype and recompute (and the parallel and
batch settings tuned alongside it) and point model.path at a compatible checkpoint that differs in a key or
two: Qwen2.5-Math-1.5B has the sizes of model=qwen2_5_1_5b but other max_position_embeddings and rope_theta.
Refusing that run would make them restate every key the checkpoint already holds. What a wrong checkpoint
breaks is refused at validation, which checks the model the run builds (engine/validate/built.py): layers
the pipeline stages do not split, heads and widths that parallel.tp (or rollout.tp) does not divide, a prompt
and response longer than its positions, a vocabulary smaller than the tokenizer's, and the MoE rules.

Keys left at the schema's default are not compared: model=tiny (the default preset) is the schema's defaults,
and `model.path=DIR` alone, as the README runs it, names no architecture to conflict with. The cost: a key
written on the command line with the schema's default value is not compared either.
"""

from __future__ import annotations

import os
from dataclasses import fields

from engine.config import ModelConfig, MoEConfig, TrainConfig
from engine.models.hf_config import HF_CONFIG_FILE, read_hf_config
from engine.validate.built import built_model


def checkpoint_conflict_warnings(cfg: TrainConfig) -> list[str]:
    """One warning line per model.* key (model.moe.* included) whose configured value is not the schema's
    default and differs from the value model.path's config.json gives it, and one where a CUDA run trains a
    half-precision checkpoint in float32; none without model.path. Reads the JSON file only; a config.json the
    engine cannot load raises `HFCheckpointError` as setup would."""
    m = cfg.model
    if not m.path:
        return []
    used = built_model(cfg)
    file = os.path.join(m.path, HF_CONFIG_FILE)
    lines = []
    for key, configured, checkpoint, default in _replaced_values(m, used):
        if configured != checkpoint and configured != default:
            lines.append(
                f"warning: model.{key}={configured!r} differs from {file} ({checkpoint!r}): the checkpoint's "
                "value is used; drop the override or fix model.path"
            )
    return lines + _float32_on_cuda(cfg, file)


def _float32_on_cuda(cfg: TrainConfig, file: str) -> list[str]:
    """A warning where a CUDA run trains a half-precision checkpoint in float32: model.dtype is the `model`
    preset's, not the checkpoint's, and the default preset (tiny) is float32, so `task=gsm8k model.path=DIR`
    on a GPU would train a bfloat16 checkpoint in float32 (twice the memory) without a word. Not refused: a
    float32 run is correct, and some want it; on CPU nothing is said (float32 is the CPU's fast type)."""
    if cfg.cluster.device != "cuda" or cfg.model.dtype != "float32":
        return []
    config = read_hf_config(cfg.model.path)
    saved = config.get("dtype") or config.get("torch_dtype")  # transformers 5 writes "dtype"
    if saved not in ("bfloat16", "float16"):
        return []
    return [
        f"warning: model.dtype=float32 trains {file} (saved in {saved}) in float32 on CUDA: twice the memory "
        f"of model.dtype={saved} and a slower step; set model.dtype={saved} (verl and TRL compute in half "
        "precision)"
    ]


def _replaced_values(configured: ModelConfig, used: ModelConfig) -> list[tuple[str, object, object, object]]:
    """(key, configured value, the value the run uses, the schema's default) for every model.* field, model.moe's
    by field. Fields config.json does not hold are equal in both. A dense checkpoint reads no model.moe field
    but num_experts, so only that one is listed."""
    default = ModelConfig()
    rows = [
        (f.name, getattr(configured, f.name), getattr(used, f.name), getattr(default, f.name))
        for f in fields(ModelConfig)
        if f.name != "moe"
    ]
    moe_keys = [f.name for f in fields(MoEConfig)] if used.moe.num_experts else ["num_experts"]
    rows += [
        (f"moe.{k}", getattr(configured.moe, k), getattr(used.moe, k), getattr(default.moe, k))
        for k in moe_keys
    ]
    return rows
