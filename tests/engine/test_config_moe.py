"""Validation of mixture-of-experts jobs (no processes): what parallel.ep and placement accept."""

from __future__ import annotations

import os

from hydra import compose, initialize_config_dir

from engine.config import TrainConfig, register_configs
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

