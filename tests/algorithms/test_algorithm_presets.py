"""Every conf/algorithm preset parses, uses only the schema's keys with the schema's types, and names
estimators, losses and modes that exist in `algorithms`."""

from pathlib import Path

import pytest
import yaml

from algorithms.advantages import advantage_estimator_names
from algorithms.kl import KL_CONTROLLERS, kl_estimator_names
from algorithms.losses import LOSS_AGG_MODES, policy_loss_names

PRESET_DIR = Path(__file__).resolve().parents[2] / "conf" / "algorithm"
PRESETS = ["ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "remax", "gspo"]

# The `algorithm` schema (engine/config.py) with its defaults, as agreed in issue 6.
SCHEMA = {
    "name": "grpo",
    "adv_estimator": "grpo",
    "norm_adv_by_std": True,
    "gamma": 1.0,
    "lam": 1.0,
    "policy_loss": "ppo",
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0,
    "loss_agg_mode": "token-mean",
    "kl_loss_coef": 0.0,
    "kl_estimator": "k3",
    "kl_in_reward": False,
    "kl_reward_coef": 0.0,
    "kl_ctrl": "fixed",
    "kl_target": 0.1,
    "kl_horizon": 10000,
    "entropy_coef": 0.0,
    "value_clip": 0.2,
    "tis_cap": 0.0,
    "dynamic_sampling": False,
    "overlong_buffer_len": 0,
    "overlong_buffer_frac": 0.0,
    "overlong_penalty": 1.0,
    "ppo_epochs": 1,
    "num_mini_batches": 1,
}


def load(name):
    path = PRESET_DIR / f"{name}.yaml"
    text = path.read_text()
    return text, {**SCHEMA, **yaml.safe_load(text)}


def test_every_preset_file_is_listed():
    assert sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) == sorted(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_valid(name):
    text, cfg = load(name)
    lines = text.splitlines()
    assert lines[0].startswith("# ") and "20" in lines[0], "first line cites the source (authors, year)"
    raw = yaml.safe_load(text)
    assert set(raw) <= set(SCHEMA), f"keys outside the schema: {set(raw) - set(SCHEMA)}"
    for key, value in raw.items():
        expected = type(SCHEMA[key])
        ok = isinstance(value, expected) or (expected is float and type(value) is int)
        assert ok and not (expected is not bool and isinstance(value, bool)), (
            f"{key}={value!r} is not {expected}"
        )
    assert cfg["name"] == name
    assert cfg["adv_estimator"] in advantage_estimator_names()
    assert cfg["policy_loss"] in policy_loss_names()
    assert cfg["loss_agg_mode"] in LOSS_AGG_MODES
    assert cfg["kl_estimator"] in kl_estimator_names()
    assert cfg["kl_ctrl"] in KL_CONTROLLERS
    assert 0 <= cfg["clip_ratio_low"] < 1 and cfg["clip_ratio_high"] >= 0 and cfg["clip_ratio_c"] > 1
    assert not (cfg["kl_in_reward"] and cfg["kl_reward_coef"] == 0), "kl_in_reward with a zero coefficient"
    assert not (cfg["kl_in_reward"] and cfg["kl_loss_coef"] > 0), "KL counted twice (reward and loss)"
    if cfg["dynamic_sampling"]:
        assert cfg["adv_estimator"] in ("grpo", "rloo", "opo", "reinforce_pp_baseline")


def test_presets_carry_their_signature_settings():
    assert load("ppo")[1]["adv_estimator"] == "gae" and load("ppo")[1]["lam"] == 0.95
    assert load("dr_grpo")[1]["norm_adv_by_std"] is False
    assert load("dr_grpo")[1]["loss_agg_mode"] == "seq-mean-token-sum-norm"
    dapo = load("dapo")[1]
    assert dapo["clip_ratio_high"] == 0.28 and dapo["dynamic_sampling"] and dapo["overlong_buffer_frac"] > 0
    gspo = load("gspo")[1]
    assert gspo["policy_loss"] == "gspo" and gspo["clip_ratio_high"] < 1e-3
    assert gspo["loss_agg_mode"] == "seq-mean-token-mean"


def test_schema_matches_engine_config_if_present():
    """Every key the presets may use exists in engine/config.py's AlgorithmConfig with the same default
    (the typed config may grow keys the presets leave at their defaults)."""
    config = pytest.importorskip("engine.config")
    schema_cls = getattr(config, "AlgorithmConfig", None)
    if schema_cls is None:
        pytest.skip("engine.config has no AlgorithmConfig yet")
    import dataclasses

    from omegaconf import OmegaConf

    fields = {f.name: f.default for f in dataclasses.fields(schema_cls)}
    assert {k: fields.get(k) for k in SCHEMA} == SCHEMA
    for name in PRESETS:  # the typed merge rejects unknown keys and wrong types
        merged = OmegaConf.merge(
            OmegaConf.structured(schema_cls), OmegaConf.load(PRESET_DIR / f"{name}.yaml")
        )
        assert merged.name == name
