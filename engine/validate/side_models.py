"""The critic's and the reward model's checkpoints (critic.path, reward.model_path), checked before any process
group exists as the actor's model is (engine/validate/model.py).

engine/setup.py builds both at the actor's layout (`build_critic`, `build_reward_model`) with their own
architecture from config.json: a checkpoint whose attention heads, KV groups or MLP width parallel.tp does not
divide failed inside megatron after the process groups and the actor existed, and one whose vocabulary is
smaller than the run's tokenizer raised only at setup. Here each is refused first, naming the checkpoint's
config.json key. Mixture-of-experts critics and reward models are not checked further here.
"""

from __future__ import annotations

import os
from dataclasses import replace

from algorithms.advantages import advantage_traits
from engine.config import TrainConfig
from engine.models.hf_config import HF_CONFIG_FILE, HFCheckpointError, checkpoint_model_config
from engine.validate.built import HF_NAMES
from engine.validate.model import run_tokenizer_size
from engine.validate.rules import fail
from parallel.dims import ParallelDims

_SPLIT_BY_TP = ("num_attention_heads", "num_query_groups", "ffn_hidden_size")  # model.* fields


def side_checkpoints(cfg: TrainConfig) -> list[tuple[str, str, str]]:
    """(key, path, role) of each checkpoint the run builds besides the actor's: critic.path where a critic
    is built from it, reward.model_path where set."""
    out = []
    c = cfg.critic.path
    if c and c != cfg.model.path and advantage_traits(cfg.algorithm.adv_estimator).needs_critic:
        out.append(("critic.path", c, "critic"))
    if cfg.reward.model_path:
        out.append(("reward.model_path", cfg.reward.model_path, "reward model"))
    return out


def validate_side_models(cfg: TrainConfig, dims: ParallelDims) -> None:
    """Each side checkpoint's heads and width split by parallel.tp, and its vocabulary holds the tokenizer's
    ids. Reads config.json and the tokenizer files only; a directory that does not exist was named earlier."""
    size = None
    for key, path, role in side_checkpoints(cfg):
        if not os.path.isdir(path):
            continue
        file = os.path.join(path, HF_CONFIG_FILE)
        try:
            built = checkpoint_model_config(replace(cfg.model, path=path))
        except HFCheckpointError as err:
            fail(
                key,
                path,
                f"cannot be loaded: {err}",
                f"point {key} at a checkpoint saved with save_pretrained",
            )
        for field in _SPLIT_BY_TP:
            value, name = getattr(built, field), HF_NAMES.get(field, field)
            if value % dims.tp:
                fail(
                    f"{key}'s {file}: {name}",
                    value,
                    f"must be divisible by parallel.tp={dims.tp} (the {role} is built at the actor's layout)",
                    f"lower parallel.tp or point {key} at a checkpoint whose sizes it divides",
                )
        if size is None:
            size, source = run_tokenizer_size(cfg)
        if size is not None and built.vocab_size < size:
            fail(
                f"{key}'s {file}: vocab_size",
                built.vocab_size,
                f"is smaller than the vocabulary of the tokenizer of {source}: {size} tokens, all of which "
                f"the {role} reads",
                f"point {key} at a model of the actor's family (it scores the actor's token ids)",
            )
