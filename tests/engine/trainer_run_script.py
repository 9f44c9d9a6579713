"""Run training jobs in this process, as `python -m engine.train` would (compose, validate, start the
distributed state, build, fit, tear down), without a new interpreter per job.

Imported by tests (world size 1), and run under torchrun by tests/engine/test_trainer_multirank.py
(world size 4): every rank runs the same sequence of short jobs, each checked for finite metrics, then the
dynamic-batching gradient parity at TP=2 x PP=2 (fixed vs token-budget micro-batches).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
from hydra import compose, initialize_config_dir

from engine.config import TrainConfig, register_configs, to_dataclass
from engine.validate import validate
from parallel.state import destroy_distributed, init_distributed, world_size_from_env

CONF = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "conf"))
# short CPU jobs: 4 prompts x 4 samples, 5-token responses; overrides given later win
SHORT = [
    "trainer.total_steps=2",
    "trainer.test_freq=0",
    "trainer.progress_bar=false",
    "trainer.loggers=[jsonl]",
    "data.batch_size=4",
    "rollout.n=4",
    "trainer.micro_batch_size=4",
]
register_configs()


def compose_config(overrides: list[str]) -> TrainConfig:
    """conf/train.yaml composed with `overrides`, as Hydra's command line would."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return to_dataclass(compose(config_name="train", overrides=list(overrides)))


def run_job(overrides: list[str], output_dir: str):
    """Train one job in this process; returns the Trainer (its components are torn down)."""
    from engine.setup import build_components
    from engine.trainer import Trainer

    cfg = compose_config([*SHORT, *overrides, f"trainer.output_dir={output_dir}"])
    dims = validate(cfg, world_size_from_env())
    groups = init_distributed(dims, cfg.cluster.device, cfg.cluster.timeout_s, cfg.trainer.seed)
    try:
        trainer = Trainer(build_components(cfg, groups, output_dir))
        trainer.fit()
        return trainer
    finally:
        destroy_distributed()


def read_metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_finite(rows: list[dict], steps: int, required: tuple[str, ...] = ()) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
    for row in rows:
        missing = set(required) - set(row)
        assert not missing, f"missing metric keys {sorted(missing)}"
        for key, value in row.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), f"{key}={value!r}"


CRITIC_KEYS = (
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "timing/values",
    "timing/update_critic",
)


def main(out_root: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    jobs = {
        "ppo_tp2_pp2": [
            "algorithm=ppo",
            "parallel.tp=2",
            "parallel.pp=2",
            "rollout.tp=2",
            "trainer.test_freq=2",
        ],
        "dapo_dp2_budget": [
            "algorithm=dapo",
            "algorithm.overlong_buffer_len=2",
            "parallel.tp=2",
            "trainer.max_tokens_per_micro_batch=64",
        ],
        "remax_pp2_budget": [
            "algorithm=remax",
            "parallel.pp=2",
            "algorithm.num_mini_batches=2",
            "trainer.max_tokens_per_micro_batch=96",
        ],
    }
    for name, overrides in jobs.items():
        out = os.path.join(out_root, name)
        run_job(overrides, out)
        if rank == 0:
            rows = read_metrics(out)
            check_finite(rows, 2, CRITIC_KEYS if "ppo" in name else ())
            print(f"job {name} ok", flush=True)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


if __name__ == "__main__":
    main(sys.argv[1])
