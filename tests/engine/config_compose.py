"""conf/train.yaml composed with overrides, as Hydra's command line would: the config tests' one helper."""

from __future__ import annotations

import os

from hydra import compose, initialize_config_dir

from engine.config import TrainConfig, register_configs
from engine.config_load import to_dataclass

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
register_configs()


def composed(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        return to_dataclass(compose(config_name="train", overrides=list(overrides)))
