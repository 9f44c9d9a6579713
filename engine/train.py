"""Entry point: `python -m engine.train [algorithm=grpo] [model=tiny] [cluster=cpu] [key=value ...]`.

Compose the config, validate it (before any process group exists), start the distributed state, claim the
output directory (engine/checkpoint/run_dir.py), build the components, train, and tear down in `finally`. Under
torchrun every rank runs this same file.
"""

from __future__ import annotations

import logging
import os
import re
import sys

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from engine.checkpoint.run_dir import claimed_output_dir
from engine.config import register_configs
from engine.config_load import to_dataclass
from engine.errors import exit_on_user_error
from engine.hydra_errors import report_user_errors
from engine.metrics import run_header
from engine.startup import errors_only, run_kernels_line
from engine.tools.plot import plot_at_end
from engine.validate import validate
from engine.validate.checkpoint import checkpoint_conflict_warnings
from engine.validate.ignored import ignored_key_warnings
from parallel.launch import explain_rank_failures, read_launch_env
from parallel.state import destroy_distributed, init_distributed, world_size_from_env

register_configs()


def _output_dir(configured: str) -> str:
    """trainer.output_dir, else Hydra's run dir, decided on rank 0 and shared (clocks differ across ranks)."""
    chosen = [configured or HydraConfig.get().runtime.output_dir]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
@exit_on_user_error
def main(raw: DictConfig) -> None:
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its INFO lines list every parameter bucket
    if read_launch_env().rank != 0:
        errors_only()
    cfg = to_dataclass(raw)
    dims = validate(cfg, world_size_from_env())
    warnings = ignored_key_warnings(cfg) + checkpoint_conflict_warnings(cfg)
    if cfg.placement.mode == "split":  # training and rollout ranks: engine/split/run.py
        from engine.split.run import run_split

        run_split(cfg, dims, warnings, _output_dir)
        return
    groups = init_distributed(dims, cfg.cluster.device, cfg.cluster.timeout_s, cfg.trainer.seed)
    try:
        from engine.setup import build_components
        from engine.trainer import Trainer

        with explain_rank_failures(groups.rank, dims.world_size, cfg.cluster.timeout_s):
            output_dir = _output_dir(cfg.trainer.output_dir)
            with claimed_output_dir(output_dir, cfg.trainer, groups):
                if groups.rank == 0:  # once the directory is ours: a refused run prints only its error
                    print(run_header(cfg, dims, output_dir, warnings), flush=True)
                    print(run_kernels_line(cfg, groups.device.type), flush=True)
                Trainer(build_components(cfg, groups, output_dir)).fit()
                if cfg.trainer.plot and groups.is_logging_rank:
                    print(plot_at_end(output_dir), flush=True)
    finally:
        destroy_distributed()


def _quiet_hydra_on_other_ranks() -> None:
    """Only rank 0 creates Hydra's run directory and log file; other ranks would race to make their own."""
    if read_launch_env().rank != 0:
        sys.argv += [
            "hydra.output_subdir=null",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
            "hydra.run.dir=.",
        ]


def _expand_home_in_overrides(argv: list[str]) -> list[str]:
    """`key=~/path` (and `~/` items of `key=[...]`) with the home directory: Hydra's grammar refuses `~` in
    unquoted values, and the shell does not expand it after a dotted key."""
    home = os.path.expanduser("~")
    return [re.sub(r"(?<=[=\[,])~(?=/|,|\]|$)", lambda _: home, arg) if "=" in arg else arg for arg in argv]


if __name__ == "__main__":
    _quiet_hydra_on_other_ranks()
    sys.argv[1:] = _expand_home_in_overrides(sys.argv[1:])
    launch = read_launch_env()
    report_user_errors(main, launch.rank, launch.world_size)
