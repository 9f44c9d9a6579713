"""Distributed start-up: torch.distributed from the launcher's environment (torchrun, SLURM srun or one plain
process; see `parallel/launch.py`), megatron's parallel_state, and the explicit process groups handed to the
rest of the engine.

Nothing outside `parallel/` reads megatron's global groups: callers get a `ProcessGroups` object, and hand
megatron its groups as a `ProcessGroupCollection` (`ProcessGroups.megatron_groups()`). parallel_state stays
initialised for code that still reads it, but the engine's model, DDP, optimizer and schedule calls do not.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallel.arrival import publish_process
from parallel.dims import ParallelDims
from parallel.launch import cuda_device_index, export_launch_env, read_launch_env

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass
class ExpertGroups:
    """megatron's expert-parallel groups of this rank (MoE models); expert TP is 1, so an expert's weights are
    whole on each rank that holds it, replicated over `expt_dp`."""

    ep: dist.ProcessGroup
    """Expert-parallel group: the ranks that split one MoE layer's experts (tokens go between them)."""
    tp_ep: dist.ProcessGroup
    """Tensor x expert parallel group (the token dispatcher's group)."""
    tp_ep_pp: dist.ProcessGroup
    """Tensor x expert x pipeline group (one replica of the experts)."""
    expt_dp: dist.ProcessGroup
    """Expert data-parallel group: the ranks holding the same experts (their gradients are summed)."""
    tp_dp: dist.ProcessGroup
    """Tensor x data parallel group (the router's load-balancing statistics are global over it)."""


@dataclass
class ProcessGroups:
    """The groups of this rank, plus its coordinates; created once by `init_distributed`."""

    dims: ParallelDims
    """The validated training layout."""
    device: torch.device
    """Where this rank computes: `cuda:<local_rank>` or `cpu`."""
    rank: int
    """Global rank."""
    tp: dist.ProcessGroup
    """Tensor-parallel group of this rank."""
    pp: dist.ProcessGroup
    """Pipeline-parallel group of this rank."""
    dp: dist.ProcessGroup
    """Data-parallel group of this rank."""
    mp: dist.ProcessGroup
    """Model-parallel group (tp x pp) of this rank."""
    world: dist.ProcessGroup
    """All ranks."""
    embd: dist.ProcessGroup | None
    """Tied-embedding group: the first and last stage of this rank's PP group (this rank alone at pp=1);
    None on the middle stages."""
    alone: dist.ProcessGroup
    """This rank by itself: megatron's context-parallel and expert tensor-parallel groups (the engine uses neither)."""
    timeout: datetime.timedelta = datetime.timedelta(seconds=600)
    """Collective timeout of every group above (`cluster.timeout_s`); pass it to any `dist.new_group`."""
    experts: ExpertGroups | None = None
    """Expert-parallel groups (MoE models); None where they were not created (split placement)."""
    savers: dist.ProcessGroup | None = None
    """Split placement with critic ranks: the actor's and the critic's ranks together, which write and resume one
    checkpoint (engine/checkpoint/checkpoint.py); None where `world` does."""

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp)

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group (0 without expert groups)."""
        return dist.get_rank(self.experts.ep) if self.experts is not None else 0

    def expert_offset(self, num_experts: int) -> int:
        """Global index of this rank's first local expert (each of `dims.ep` ranks holds num_experts / ep)."""
        return self.ep_rank * (num_experts // self.dims.ep)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's PP group."""
        return dist.get_global_rank(self.pp, self.dims.pp - 1)

    @property
    def is_logging_rank(self) -> bool:
        """The one rank that prints and writes metrics: global rank 0."""
        return self.rank == 0

    def holds_chunk_ends(self, vp_stage: int) -> tuple[bool, bool]:
        """(first, last): whether this rank's model chunk `vp_stage` is the whole model's first stage (it
        holds the embedding) and its last (it holds the output layer)."""
        return (
            self.is_first_stage and vp_stage == 0,
            self.is_last_stage and vp_stage == self.dims.vpp - 1,
        )

    def as_one_stage(self) -> ProcessGroups:
        """These groups as if parallel.pp, vpp and ep were 1 (every layer and every expert on this rank, the
        TP and DP groups kept), for building the whole model of this rank's TP shard (engine/models/builder.py
        `build_gpt_chunks_layout_invariant`); not for training."""
        e = self.experts
        experts = None
        if e is not None:
            experts = ExpertGroups(
                ep=self.alone, tp_ep=self.tp, tp_ep_pp=self.tp, expt_dp=self.dp, tp_dp=e.tp_dp
            )
        d = self.dims
        dims = dataclasses.replace(
            d, world_size=d.world_size // d.pp, pp=1, vpp=1, first_stage_layers=0, last_stage_layers=0, ep=1
        )
        return dataclasses.replace(
            self, dims=dims, pp=self.alone, mp=self.tp, embd=self.alone, experts=experts
        )

    def megatron_groups(self) -> ProcessGroupCollection:
        """These groups as megatron-core's `ProcessGroupCollection`, for GPTModel, DDP, the optimizer,
        the schedules and finalize_model_grads (`pg_collection=`).

        With no context parallelism, megatron's data-parallel-with-context group is dp and its
        tensor-with-context groups are tp and tp x dp; the expert groups are `experts` (for a dense model
        without them: ep alone, expert data parallel = dp, tp_ep_pp = mp). The distributed optimizer (one
        instance) reduces gradient statistics over every rank of the role (`world`). The engine's models
        have no learned position embeddings (RoPE), so no position-embedding group.
        """
        from megatron.core.process_groups_config import ProcessGroupCollection

        e = self.experts
        extra = {}
        if e is not None:
            extra = dict(expt_tp=self.alone, tp_ep=e.tp_ep, tp_cp=self.tp, tp_dp_cp=e.tp_dp)
        return ProcessGroupCollection(
            tp=self.tp,
            pp=self.pp,
            mp=self.mp,
            embd=self.embd,
            pos_embd=None,
            cp=self.alone,
            ep=e.ep if e else self.alone,
            dp=self.dp,
            dp_cp=self.dp,
            expt_dp=e.expt_dp if e else self.dp,
            tp_ep_pp=e.tp_ep_pp if e else self.mp,
            intra_dist_opt=self.world,
            **extra,
        )


def world_size_from_env() -> int:
    """World size torchrun or SLURM srun announces; 1 for a plain process. Raises `LaunchError` if inconsistent."""
    return read_launch_env().world_size


def init_distributed(
    dims: ParallelDims, device_type: str = "cpu", timeout_s: float = 600.0, seed: int = 0
) -> ProcessGroups:
    """Start torch.distributed and megatron's parallel state for `dims`; return this rank's groups.

    `device_type` is "cpu" (gloo, megatron CPU shims applied) or "cuda" (NCCL, one GPU per local rank).
    A plain `python -m ...` process becomes a world of one on a free local port. `timeout_s` bounds every
    collective of the default group and of megatron's groups: a rank that died makes the others fail after it.
    """
    from megatron.core import parallel_state, tensor_parallel

    launch = read_launch_env()
    if device_type == "cpu":
        from parallel.cpu import install_cpu_shims

        install_cpu_shims()
        device = torch.device("cpu")
        backend = "gloo"
    else:
        gpu = cuda_device_index(launch.local_rank, torch.cuda.device_count())
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
        backend = "nccl"

    if not dist.is_initialized():
        # env:// reads these variables; so do libraries that look for RANK / LOCAL_RANK themselves.
        launch = export_launch_env(launch)
        dist.init_process_group(
            backend=backend,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if dist.get_world_size() != dims.world_size:
        raise RuntimeError(
            f"the job has {dist.get_world_size()} ranks but the layout was validated for {dims.world_size}"
        )
    if dist.get_world_size() > 1:
        publish_process(dist.get_rank())  # lets a rank that times out name and stop a stuck peer
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=timeout_s / 60,  # megatron makes a timedelta of it: keep seconds exact
        create_gloo_process_groups=(backend == "gloo"),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ProcessGroups(
        dims=dims,
        device=device,
        rank=dist.get_rank(),
        tp=parallel_state.get_tensor_model_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group(),
        dp=parallel_state.get_data_parallel_group(),
        mp=parallel_state.get_model_parallel_group(),
        world=dist.group.WORLD,
        embd=parallel_state.get_embedding_group(check_initialized=False),
        alone=parallel_state.get_context_parallel_group(),
        timeout=datetime.timedelta(seconds=timeout_s),
        experts=ExpertGroups(
            ep=parallel_state.get_expert_model_parallel_group(),
            tp_ep=parallel_state.get_expert_tensor_and_model_parallel_group(),
            tp_ep_pp=parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
            expt_dp=parallel_state.get_expert_data_parallel_group(),
            tp_dp=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True),
        ),
    )


def destroy_model_parallel_groups() -> None:
    """Tear down megatron's parallel state and destroy every process group but the default one, so that one
    process can lay megatron out again (tests and tools that try several layouts in one launch).

    megatron's `destroy_model_parallel` only drops its groups: each gloo group keeps its I/O threads, and a rank
    that re-laid itself out ~35 times held ~1,800 threads (a CI launch ran past its timeout on 2 cores). Groups
    the engine made itself (the hybrid engine's rollout groups) go too: nothing may use an earlier layout's
    groups after this.
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # also where it is half gone: its globals become None either way
    parallel_state.destroy_global_memory_buffer()
    if dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not dist.group.WORLD:
                dist.destroy_process_group(group)


def destroy_distributed() -> None:
    """Tear down megatron's state and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.destroy_global_memory_buffer()  # split placement sets it without parallel_state's groups
    if dist.is_initialized():
        dist.destroy_process_group()


def init_split_distributed(
    dims: ParallelDims,
    world_size: int,
    device_type: str = "cpu",
    timeout_s: float = 600.0,
    seed: int = 0,
    critic: ParallelDims | None = None,
) -> tuple[ProcessGroups | None, dist.ProcessGroup]:
    """Split placement: start torch.distributed over all `world_size` ranks; the first `dims.world_size` ranks
    train with `dims`, the next `critic.world_size` (if `critic`) train PPO's critic with that layout, the others
    only generate. Returns (this rank's training groups: the actor's or, on a critic rank, the critic's; None on
    a rollout rank; the group of all ranks).

    megatron's parallel_state lays its groups over the whole world, so it stays uninitialised here: the
    training groups are built from `TrainLayout`'s rank lists (megatron's rank order) and handed to megatron
    explicitly, as on the colocated path; the expert groups are those of parallel.ep=1 (an MoE model holds
    every expert on every training rank). Every rank creates every group (torch requires it), in one order.
    Of parallel_state's other state, the global memory buffer is set (megatron's sequence-parallel all-gathers
    and attention take their buffers from it; `destroy_distributed` releases it).
    """
    from megatron.core import parallel_state, tensor_parallel

    launch = read_launch_env()
    if device_type == "cpu":
        from parallel.cpu import install_cpu_shims

        install_cpu_shims()
        device, backend = torch.device("cpu"), "gloo"
    else:
        gpu = cuda_device_index(launch.local_rank, torch.cuda.device_count())
        torch.cuda.set_device(gpu)
        device, backend = torch.device("cuda", gpu), "nccl"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        launch = export_launch_env(launch)
        dist.init_process_group(
            backend=backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout
        )
    if dist.get_world_size() != world_size:
        raise RuntimeError(f"the job has {dist.get_world_size()} ranks but was validated for {world_size}")
    rank = dist.get_rank()
    publish_process(rank)
    layout = dims.train_layout()

    def mine(rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
        found = None
        for ranks in rank_lists:
            group = dist.new_group(ranks, timeout=timeout)
            found = group if rank in ranks else found
        return found

    def training_groups(layout, first: int) -> tuple:
        """(world, tp, pp, dp, mp, embd, tp_dp) of `layout` laid over ranks [first, first + its world size)."""

        def shift(rank_lists: list[list[int]]) -> list[list[int]]:
            return [[first + r for r in ranks] for ranks in rank_lists]

        world = mine([list(range(first, first + layout.world_size))])
        tp, pp, dp = (
            mine(shift(lists)) for lists in (layout.tp_groups(), layout.pp_groups(), layout.dp_groups())
        )
        mp = mine(
            shift(
                [
                    [r for r in range(layout.world_size) if layout.coords(r).dp_rank == d]
                    for d in range(layout.dp)
                ]
            )
        )
        embd = mine(shift([sorted({g[0], g[-1]}) for g in layout.pp_groups()]))
        stages = [
            [r for r in range(layout.world_size) if layout.coords(r).pp_rank == s] for s in range(layout.pp)
        ]
        tp_dp = mine(shift(stages))
        return world, tp, pp, dp, mp, embd, tp_dp

    train_world, tp, pp, dp, mp, embd, tp_dp = training_groups(layout, 0)
    alone = mine([[r] for r in range(world_size)])
    local, savers = rank, None
    if critic is not None:
        critic_groups = training_groups(critic.train_layout(), dims.world_size)
        savers = mine([list(range(dims.world_size + critic.world_size))])
        if dims.world_size <= rank < dims.world_size + critic.world_size:
            local = rank - dims.world_size
            dims, layout = critic, critic.train_layout()
            train_world, tp, pp, dp, mp, embd, tp_dp = critic_groups
    if train_world is None:  # a rollout rank
        return None, dist.group.WORLD
    parallel_state.destroy_global_memory_buffer()  # a process may set up split placement more than once
    parallel_state._set_global_memory_buffer()  # what initialize_model_parallel ends with
    coords = layout.coords(local)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=coords.tp_rank, ep_rank=0, etp_rank=0)
    groups = ProcessGroups(
        dims=dims,
        device=device,
        rank=rank,
        tp=tp,
        pp=pp,
        dp=dp,
        mp=mp,
        world=train_world,
        embd=embd,
        alone=alone,
        timeout=timeout,
        savers=savers,
        # MoE at parallel.ep=1 (validated): megatron's groups for ep=1 and expert TP 1, as on the colocated
        # path. Every expert is whole on every rank and (with sequence parallelism at tp > 1) each TP rank
        # routes its own tokens, so the experts' gradients are summed over TP x DP: expt_dp is the stage's
        # tp x dp group, and the expert TP x EP group is this rank alone.
        experts=ExpertGroups(ep=alone, tp_ep=alone, tp_ep_pp=pp, expt_dp=tp_dp, tp_dp=tp_dp),
    )
    return groups, dist.group.WORLD


_BUILT = "built"


def join_megatron_world_gathers() -> None:
    """Split placement, on a rollout rank: take part in the all-gathers that megatron-core makes over the
    default group (all ranks) while the training ranks build (`get_megatron_optimizer` gathers every rank's
    param-group keys, for dense and expert parameters, per optimizer); a rollout rank contributes no keys.
    Returns at the gather of `end_megatron_world_gathers`, so megatron's count of gathers is not assumed."""
    while True:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [])
        if _BUILT in gathered:
            return


def end_megatron_world_gathers() -> None:
    """Split placement, on a training rank, once every model role is built: release the rollout ranks from
    `join_megatron_world_gathers` (a collective of all ranks)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _BUILT)
