"""Validation of mixture-of-experts jobs (no processes): what parallel.ep and placement accept."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir

from engine.config import ConfigError, TrainConfig, register_configs
from engine.config_load import to_dataclass
from engine.validate import validate

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
register_configs()


def composed(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        return to_dataclass(compose(config_name="train", overrides=list(overrides)))


def test_expert_parallel_run_may_export_to_hugging_face():
    """trainer.export_hf at parallel.ep=2 (alone and with TP=2 x SP): the export gathers the experts."""
    for extra in ((), ("parallel.tp=2", "parallel.sp=true", "rollout.tp=2")):
        cfg = composed("model=tiny_moe", "parallel.ep=2", "trainer.export_hf=true", *extra)
        dims = validate(cfg, world_size=4)
        assert (dims.ep, cfg.trainer.export_hf) == (2, True)


def test_split_placement_trains_moe_at_ep1_and_refuses_expert_parallel():
    """placement.mode=split with an MoE actor: accepted at parallel.ep=1 (the transfer sends each expert
    whole), refused at parallel.ep=2 naming the keys and the fix."""
    split = ("model=tiny_moe", "placement.mode=split", "placement.rollout_ranks=1")
    dims = validate(composed(*split), world_size=2)
    assert (dims.world_size, dims.ep) == (1, 1)  # the training ranks' layout
    with pytest.raises(ConfigError) as err:
        validate(composed(*split, "parallel.ep=2"), world_size=3)
    message = str(err.value)
    assert "placement.mode='split'" in message and "parallel.ep=1 only" in message, message
    assert "Fix: set parallel.ep=1 or placement.mode=colocated" in message, message
