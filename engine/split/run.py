"""Start-up of a split-placement run (`python -m engine.train placement.mode=split ...`): the distributed state
over all ranks, the output directory claimed for all of them, then a training rank builds `Components` with a
`TrainerLink` (no rollout engine, no hybrid engine; but an idle one where the engine's start spans every
rank: vLLM) and runs the `Trainer`; a critic rank (placement.critic_ranks) builds a `CriticWorker`; a rollout
rank builds a `RolloutWorker` and serves the steps. All ranks construct the weight transfer together (a
collective)."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.checkpoint.run_dir import claimed_output_dir_over
from engine.config import TrainConfig
from engine.metrics import run_header
from engine.startup import run_kernels_line
from engine.tools.plot import plot_at_end
from engine.validate.placement import critic_dims
from parallel.dims import ParallelDims
from parallel.launch import explain_rank_failures
from parallel.rollout_weights import global_param_names
from parallel.split_plan import SplitLayout
from parallel.split_transfer import SplitTransfer
from parallel.state import (
    destroy_distributed,
    end_megatron_world_gathers,
    init_split_distributed,
    join_megatron_world_gathers,
    world_size_from_env,
)


def run_split(
    cfg: TrainConfig, dims: ParallelDims, warnings: list[str], output_dir_of: Callable[[str], str]
) -> None:
    """Run the job on this rank (training or rollout, by rank); `dims` is the validated training layout,
    `output_dir_of` decides trainer.output_dir for all ranks (a collective)."""
    world_size = world_size_from_env()
    c = cfg.cluster
    critic = critic_dims(cfg, dims)
    groups, everyone = init_split_distributed(
        dims, world_size, c.device, c.timeout_s, cfg.trainer.seed, critic=critic
    )
    try:
        rank = dist.get_rank()
        layout = SplitLayout(
            dims.train_layout(),
            cfg.rollout.tp,
            cfg.placement.rollout_ranks,
            critic=critic.train_layout() if critic is not None else None,
        )
        device = groups.device if groups is not None else _rollout_device(c.device)
        side = "rollout" if groups is None else "critic" if layout.is_critic_rank(rank) else "training"
        with explain_rank_failures(rank, world_size, c.timeout_s, side, layout.describe_rank):
            output_dir = output_dir_of(cfg.trainer.output_dir)
            with claimed_output_dir_over(output_dir, cfg.trainer, rank, world_size, everyone, device):
                if rank == 0:
                    print(run_header(cfg, dims, output_dir, warnings), flush=True)
                    print(
                        f"placement: split, ranks 0-{dims.world_size - 1} train, ranks {layout.rollout_start}-"
                        f"{world_size - 1} generate (rollout.tp={layout.rollout_tp} x DP {layout.rollout_dp})"
                        + _critic_line(critic, dims.world_size),
                        flush=True,
                    )
                    print(run_kernels_line(cfg, device.type), flush=True)
                if groups is None:
                    _serve(cfg, layout, rank, everyone, device, output_dir)
                elif side == "critic":
                    _critic(cfg, layout, groups, everyone, output_dir)
                else:
                    _train(cfg, layout, groups, everyone, output_dir)
    finally:
        destroy_distributed()


def _critic_line(critic: ParallelDims | None, first: int) -> str:
    if critic is None:
        return ""
    return (
        f", ranks {first}-{first + critic.world_size - 1} train the critic "
        f"(TP {critic.tp} x PP {critic.pp} x DP {critic.dp})"
    )


def _critic(cfg: TrainConfig, layout: SplitLayout, groups, everyone, output_dir: str) -> None:
    from engine.split.critic import build_critic_worker

    worker = build_critic_worker(cfg, layout, groups, everyone, output_dir)
    end_megatron_world_gathers()  # the critic's optimizer gathers with the actor's
    tie = worker.side.critic.shape.tie_embeddings
    SplitTransfer(layout, groups.rank, None, tie, groups.device, everyone, groups.timeout)
    worker.run()


def _rollout_device(device_type: str) -> torch.device:
    """A rollout rank's device: the GPU `init_split_distributed` selected, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def _serve(cfg: TrainConfig, layout: SplitLayout, rank: int, everyone, device, output_dir: str) -> None:
    from engine.split.worker import build_rollout_worker

    worker = build_rollout_worker(cfg, layout, rank, everyone, device, output_dir)
    join_megatron_world_gathers()  # while the training ranks build their optimizers
    timeout = datetime.timedelta(seconds=cfg.cluster.timeout_s)
    worker.transfer = SplitTransfer(layout, rank, None, worker.tie_embeddings, device, everyone, timeout)
    worker.run()


def _train(cfg: TrainConfig, layout: SplitLayout, groups, everyone, output_dir: str) -> None:
    from engine.setup import build_components
    from engine.split.link import TrainerLink
    from engine.trainer import Trainer

    idle_engine = _idle_rollout_engine(cfg, groups.device, output_dir)
    c = build_components(cfg, groups, output_dir)
    end_megatron_world_gathers()
    layers = groups.dims.train_layout().layers(groups.pp_rank, c.shape.num_layers)
    local = global_param_names(c.actor.chunks, layers)
    transfer = SplitTransfer(
        layout, groups.rank, local, c.shape.tie_embeddings, groups.device, everyone, groups.timeout
    )
    c.split = TrainerLink(transfer, layout, groups, everyone, cfg.trainer.off_policy_steps)
    c.split.idle_engine = idle_engine
    Trainer(c).fit()
    if cfg.trainer.plot and groups.is_logging_rank:
        print(plot_at_end(output_dir), flush=True)


def _idle_rollout_engine(cfg: TrainConfig, device: torch.device, output_dir: str):
    """A training rank's part in starting the rollout ranks' engine when that start is a collective over every
    rank (`starts_on_every_rank`: vLLM), left asleep for the run; None otherwise. Started first, as the rollout
    ranks start theirs before any other collective (engine/split/worker.py `build_rollout_worker`), and with this
    process's random generators kept (vLLM reseeds them), so the actor initialises as without it."""
    from engine.checkpoint.checkpoint_state import rng_state, set_rng_state
    from engine.data import load_tokenizer
    from engine.rollout import build_rollout_engine, starts_on_every_rank
    from engine.setup import _data_files, model_shape

    if not starts_on_every_rank(cfg.rollout.backend):
        return None
    tok_dir, _, _ = _data_files(cfg, output_dir)
    tokenizer = load_tokenizer(
        tok_dir, key="model.path" if tok_dir == cfg.model.path else "model.tokenizer_path"
    )
    shape = model_shape(cfg.model, len(tokenizer), cfg.parallel.tp)
    states = rng_state(device)
    engine = build_rollout_engine(
        cfg.rollout, shape, device, tokenizer.pad_token_id, model_dir=cfg.model.path, seed=cfg.trainer.seed
    )
    set_rng_state(states, device)
    return engine
