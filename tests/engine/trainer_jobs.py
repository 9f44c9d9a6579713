"""Run training jobs in this process, as `python -m engine.train` would (compose, validate, start the
distributed state, build, fit, tear down), without a new interpreter per job; read and check their metrics.

Imported by tests (world size 1) and by tests/engine/trainer_run_script.py under torchrun.
"""

from __future__ import annotations

import contextlib
import json
import math
import os

from hydra import compose, initialize_config_dir

from engine.config import TrainConfig, register_configs
from engine.config_load import to_dataclass
from engine.validate import validate
from parallel.state import (
    destroy_distributed,
    destroy_model_parallel_groups,
    init_distributed,
    world_size_from_env,
)

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
# the embedded calculator task as multi-turn episodes with the compact tool-call format
CALCULATOR_TASK = [
    "data.embedded_task=calculator",
    "data.embedded_digits=1",
    "rollout.multi_turn.enable=true",
    "rollout.multi_turn.tool_format=compact",
    "rollout.multi_turn.tools=[calculator]",
    "rollout.multi_turn.max_turns=2",
    "rollout.multi_turn.max_total_tokens=24",
    "rollout.max_new_tokens=4",
]
register_configs()


def compose_config(overrides: list[str]) -> TrainConfig:
    """conf/train.yaml composed with `overrides`, as Hydra's command line would."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return to_dataclass(compose(config_name="train", overrides=list(overrides)))


@contextlib.contextmanager
def distributed(cfg: TrainConfig, keep_process_group: bool = False):
    """Validate `cfg` and start the distributed state as engine.train does; on exit tear down megatron's
    state, and the default process group unless kept (under torchrun a second init_process_group would
    find the first one's addresses in the agent's store). A kept process group keeps the job's groups too,
    until the next job starts (callers check a finished job's components): they are destroyed then, not
    dropped (each gloo group keeps its threads). A world of one puts back the environment: init_distributed
    exports MASTER_PORT & co, which later subprocesses of the test run would inherit."""
    from megatron.core import parallel_state

    saved = dict(os.environ)
    dims = validate(cfg, world_size_from_env())
    destroy_model_parallel_groups()  # the previous job's, kept for its caller until now
    groups = init_distributed(dims, cfg.cluster.device, cfg.cluster.timeout_s, cfg.trainer.seed)
    try:
        yield groups
    finally:
        if keep_process_group:
            parallel_state.destroy_model_parallel()
        else:
            destroy_distributed()
            os.environ.clear()
            os.environ.update(saved)


@contextlib.contextmanager
def built_job(overrides: list[str], output_dir: str):
    """The Components of one job (not trained), torn down on exit."""
    from engine.setup import build_components

    cfg = compose_config([*SHORT, *overrides, f"trainer.output_dir={output_dir}"])
    with distributed(cfg) as groups:
        yield build_components(cfg, groups, output_dir)


def run_job(overrides: list[str], output_dir: str, keep_process_group: bool = False):
    """Train one job in this process; returns the Trainer (its components are torn down). Every rank leaves
    after the job's files (metrics.jsonl, written by one rank) are complete, so any rank may read them."""
    import torch.distributed as dist

    from engine.setup import build_components
    from engine.trainer import Trainer

    cfg = compose_config([*SHORT, *overrides, f"trainer.output_dir={output_dir}"])
    with distributed(cfg, keep_process_group) as groups:
        trainer = Trainer(build_components(cfg, groups, output_dir))
        trainer.fit()
        if dist.is_initialized():
            dist.barrier()
        return trainer


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
