"""Checks on the composed configuration, run before any process group or model exists.

Each check raises `ConfigError` naming the key(s), the value, the rule and a fix. The order follows the
config groups so that the first message a user sees is about the first thing they would look at. One module
per concern: placement (which ranks train and which generate), model (layout, architecture, checkpoint
files), built (the model the run builds, which the architecture checks read: model.path's config.json when
set), algorithm, rollout, batches, run (optimizer, trainer, reward, optional packages), ignored (keys a
combination ignores), checkpoint (model keys whose values model.path's checkpoint replaces with others),
side_models (the critic's and the reward model's checkpoints at the actor's layout), rules (the raising helpers).
"""

from __future__ import annotations

from engine.config import TrainConfig
from engine.validate.algorithm import validate_algorithm
from engine.validate.batches import validate_batches
from engine.validate.model import validate_model, validate_parallel
from engine.validate.placement import training_world_size, validate_placement
from engine.validate.rollout import validate_rollout
from engine.validate.run import (
    validate_cuda_graphs,
    validate_optim,
    validate_optional_packages,
    validate_reward,
    validate_share_prompts,
    validate_trainer,
)
from engine.validate.side_models import validate_side_models
from parallel.dims import ParallelDims


def validate(cfg: TrainConfig, world_size: int) -> ParallelDims:
    """Check every group and cross-group rule; return the validated training layout (over the actor's
    training ranks: all of `world_size` unless placement.mode=split)."""
    dims = validate_parallel(cfg, training_world_size(cfg, world_size))
    built = validate_model(cfg, dims)
    validate_placement(cfg, dims, built)
    validate_algorithm(cfg, built)
    validate_rollout(cfg, dims, built)
    validate_batches(cfg, dims)
    validate_optim(cfg)
    validate_trainer(cfg)
    validate_cuda_graphs(cfg, built)
    validate_share_prompts(cfg, built)
    validate_reward(cfg)
    validate_side_models(cfg, dims)
    validate_optional_packages(cfg)
    return dims
