"""World size 2: rank 1 dies or hangs; rank 0 must fail within cluster.timeout_s with a clear message.

    launch_dead_rank.py MODE TIMEOUT_S     (under torchrun, or two plain processes with RANK, WORLD_SIZE, ...)

MODE `die`: rank 1 exits abruptly (os._exit(1)) while rank 0 waits in a collective. MODE `hang`: rank 1 stays
alive but never joins (the test kills it). MODE `stop`: rank 1 stops itself (SIGSTOP), as a debugger or an
operator would. Rank 0 runs one all-reduce on megatron's DP group and one on the
world group, prints `FAILED <group> <seconds>` for each, then re-raises the last error inside
`explain_rank_failures` and tears down as `engine.train` does, so it exits non-zero with the note a user
would see.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from parallel.dims import ParallelDims
from parallel.launch import explain_rank_failures
from parallel.state import destroy_distributed, init_distributed


def main() -> None:
    mode, timeout_s = sys.argv[1], float(sys.argv[2])
    groups = init_distributed(ParallelDims(world_size=2), "cpu", timeout_s=timeout_s)
    dist.all_reduce(torch.ones(1), group=groups.dp)  # both alive: the groups work
    if groups.rank == 1:
        if mode == "die":
            time.sleep(0.5)  # rank 0 is inside its collective by now
            print(f"DYING {time.time():.3f}", flush=True)
            os._exit(1)
        if mode == "stop":
            print(f"STOPPING {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # hang: alive, connections open, never joining
    try:  # as in engine.train: the note, then the teardown (which must not hang either)
        with explain_rank_failures(groups.rank, groups.dims.world_size, timeout_s):
            failure = None
            for name in ("dp", "world"):
                start = time.monotonic()
                try:
                    dist.all_reduce(torch.ones(1), group=getattr(groups, name))
                except RuntimeError as err:
                    print(f"FAILED {name} {time.monotonic() - start:.2f}", flush=True)
                    failure = err
            if failure is None:
                raise AssertionError("collectives completed although rank 1 was gone")
            raise failure
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
