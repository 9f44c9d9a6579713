"""torchrun script for tests/parallel/test_split_expert_groups.py: split placement's training ranks get the
expert groups megatron's parallel_state lays out for the same training layout at parallel.ep=1 (expert TP 1),
which is what the colocated path (parallel/state.py `init_distributed`) hands to megatron."""

from __future__ import annotations

import sys

import torch.distributed as dist
from megatron.core.parallel_state import RankGenerator

from parallel.dims import ParallelDims
from parallel.state import init_split_distributed


def megatron_expert_groups(world: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """megatron's expert groups (initialize_model_parallel with expert_model_parallel_size=1,
    expert_tensor_parallel_size=1) of a world of `world` training ranks, by ExpertGroups field."""
    gen = RankGenerator(tp=1, ep=1, dp=world // pp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    return {
        "ep": gen.get_ranks("ep"),
        "tp_ep": gen.get_ranks("tp-ep"),
        "tp_ep_pp": gen.get_ranks("tp-ep-pp"),
        "expt_dp": gen.get_ranks("dp"),
    }


def main() -> None:
    tp, pp, rollout_ranks = (int(a) for a in sys.argv[1:4])
    world = int(__import__("os").environ["WORLD_SIZE"])
    train = world - rollout_ranks
    dims = ParallelDims(world_size=train, tp=tp, pp=pp, sp=tp > 1)
    groups, _ = init_split_distributed(dims, world, "cpu")
    if groups is not None:
        want = megatron_expert_groups(train, tp, pp)
        for name, lists in want.items():
            got = sorted(dist.get_process_group_ranks(getattr(groups.experts, name)))
            mine = [sorted(r) for r in lists if dist.get_rank() in r]
            assert [got] == mine, f"rank {dist.get_rank()}: experts.{name} = {got}, megatron's: {mine}"
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
