"""The composed Hydra config as a typed `TrainConfig` (`to_dataclass`), and the message for a key the schema
(engine/config.py) does not declare."""

from __future__ import annotations

import difflib
import os

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.config import ConfigError, TrainConfig


def to_dataclass(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """The composed DictConfig as a plain TrainConfig object (typed attribute access everywhere else).

    Keys the schema does not declare are refused: Hydra's `+key=value` appends them to the composed config
    without complaint, and they would be ignored."""
    if isinstance(cfg, TrainConfig):
        return cfg
    schema = OmegaConf.to_container(OmegaConf.structured(TrainConfig))
    for key, value in _unknown_keys(OmegaConf.to_container(cfg, resolve=False), schema, ""):
        raise ConfigError(unknown_key_message(key, value))
    try:
        out = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))
    except OmegaConfBaseException as err:  # e.g. `key=${oops}`: an interpolation naming no key
        key = getattr(err, "full_key", None) or "the config"
        raise ConfigError(
            f"{key}: {type(err).__name__}: {str(err).splitlines()[0]}. Fix: give it a plain value, or "
            "${...} naming an existing key"
        ) from None
    out.data.train_files = _file_list("data.train_files", out.data.train_files)
    out.data.val_files = _file_list("data.val_files", out.data.val_files)
    return out


def _file_list(key: str, value: object) -> list[str]:
    """One path (verl's `data.train_files=~/data/train.parquet`) or a list of paths, as a list with `~`
    expanded."""
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) and p for p in paths):
        raise ConfigError(
            f"{key}={value!r}: must be a path or a list of paths. Fix: {key}=/data/train.parquet or "
            f"{key}=[/data/a.parquet,/data/b.parquet]"
        )
    return [os.path.expanduser(p) for p in paths]


def _unknown_keys(given: dict, schema: dict, prefix: str):
    """(dotted key, value) of every key in `given` that `schema` lacks, depth first."""
    for key, value in given.items():
        if key not in schema:
            yield f"{prefix}{key}", value
        elif isinstance(schema[key], dict) and isinstance(value, dict):
            yield from _unknown_keys(value, schema[key], f"{prefix}{key}.")


def _schema_keys(schema: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in schema.items():
        keys += _schema_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


def unknown_key_message(key: str, value: object) -> str:
    """The ConfigError text for a key the schema does not declare, with the closest declared key."""
    known = _schema_keys(OmegaConf.to_container(OmegaConf.structured(TrainConfig)))
    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    close = [siblings[m] for m in difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)]
    close = close or difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if close:
        fix = f"did you mean {close[0]}={value!r}?"
    elif siblings:
        fix = f"use one of {', '.join(siblings.values())}"
    else:
        fix = "remove it"
    return (
        f"{key}={value!r}: not a key of the configuration (every key is declared in engine/config.py; "
        f"keys cannot be added with +). Fix: {fix} (`python -m engine.train --cfg job` prints every key)"
    )
