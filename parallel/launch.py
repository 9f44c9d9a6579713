"""Who this process is in the job: rank, world size, local rank and rendezvous address, read from the launcher.

Two launchers are understood, and nothing else is invented (PyTorch's own stack does the rest):
- torchrun (also one torchrun per node under SLURM `srun`): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT. These win whenever RANK or WORLD_SIZE is set.
- SLURM with one `srun` task per GPU (no torchrun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID,
  the tasks per node (SLURM_NTASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE, e.g. `4(x2)`)
  and the node list (SLURM_STEP_NODELIST or SLURM_JOB_NODELIST, e.g. `gpu[01-03,07],login5`); the
  rendezvous is the first node on MASTER_PORT or a port derived from SLURM_JOB_ID. Only used inside an srun
  step (SLURM_STEP_ID set): a batch script that runs python directly is one process, not SLURM_NTASKS.
- Neither: a plain process, a world of one on 127.0.0.1 and a free port.

Everything here is pure parsing of an environment mapping (no process groups), so it is unit-tested without
processes; `explain_rank_failures` is the one piece that looks at a live job. Inconsistent environments
raise `LaunchError` naming the variable and the fix.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

LOOPBACK = "127.0.0.1"
SLURM_PORT_BASE = 20000
"""Without MASTER_PORT, an srun-per-GPU job rendezvous on SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN."""
SLURM_PORT_SPAN = 10000


class LaunchError(RuntimeError):
    """The launcher's environment is missing a variable or contradicts itself; the message says how to fix it."""


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job, as the launcher announced it."""

    rank: int
    """Global rank, 0 <= rank < world_size."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Index of this process on its node (picks the GPU)."""
    local_world_size: int
    """Processes on this node (LOCAL_WORLD_SIZE; WORLD_SIZE when a torchrun-style launcher does not say)."""
    master_addr: str
    """Host of the rendezvous store (rank 0's node for a static launch)."""
    master_port: int
    """Port of the rendezvous store; 0 = any free port (only for a world of one)."""
    source: str
    """`torchrun`, `slurm` or `single`: which variables these values came from."""

    def as_torch_env(self) -> dict[str, str]:
        """The torchrun variables that describe this process (what `init_process_group("env://")` reads)."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Rank, world and rendezvous of this process from torchrun's variables, else SLURM's, else a world of one."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return _from_slurm(env)
    return LaunchEnv(0, 1, 0, 1, LOOPBACK, 0, "single")


def export_launch_env(launch: LaunchEnv, environ: MutableMapping[str, str] | None = None) -> LaunchEnv:
    """Write `launch` as torchrun variables (choosing a free port for a world of one) and return what was written.

    Libraries that read RANK / LOCAL_RANK themselves (and `env://` initialisation) then agree with us.
    """
    env = os.environ if environ is None else environ
    if launch.master_port == 0:
        launch = replace(launch, master_port=free_port())
    env.update(launch.as_torch_env())
    return launch


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (another process may still take it before we do)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cuda_device_index(local_rank: int, num_visible: int) -> int:
    """The GPU of this process: LOCAL_RANK, or 0 when the launcher bound one GPU per task (`--gpus-per-task=1`)."""
    if num_visible == 1:
        return 0
    if not 0 <= local_rank < num_visible:
        raise LaunchError(
            f"LOCAL_RANK={local_rank} but this node shows {num_visible} CUDA devices. Fix: start at most "
            f"{num_visible} processes per node (torchrun --nproc_per_node / srun --ntasks-per-node) or check "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
        )
    return local_rank


# --- torchrun -------------------------------------------------------------------------------------------


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    for name, partner in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if name not in env:
            raise LaunchError(
                f"{partner}={env[partner]} is set but {name} is not. Fix: set both (torchrun sets them for "
                f"every process), or neither for a single process"
            )
    world_size = _int(env, "WORLD_SIZE", minimum=1)
    rank = _int(env, "RANK", minimum=0)
    if rank >= world_size:
        raise LaunchError(
            f"RANK={rank} must be < WORLD_SIZE={world_size}. Fix: number ranks 0..{world_size - 1}, or raise "
            f"WORLD_SIZE to the number of processes started"
        )
    if world_size > 1 and "LOCAL_RANK" not in env:
        raise LaunchError(
            f"LOCAL_RANK is not set in a job of WORLD_SIZE={world_size}. Fix: launch with torchrun, or set "
            f"LOCAL_RANK to this process's index on its node (it picks the GPU)"
        )
    local_rank = _int(env, "LOCAL_RANK", minimum=0) if "LOCAL_RANK" in env else 0
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", minimum=1) if "LOCAL_WORLD_SIZE" in env else world_size
    if local_world_size > world_size:
        raise LaunchError(
            f"LOCAL_WORLD_SIZE={local_world_size} exceeds WORLD_SIZE={world_size}. Fix: WORLD_SIZE counts the "
            f"processes of all nodes (torchrun: --nnodes x --nproc_per_node)"
        )
    if local_rank >= local_world_size:
        raise LaunchError(
            f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world_size} (processes on this node). "
            f"Fix: number the processes of each node 0..{local_world_size - 1}"
        )
    addr, port = _rendezvous(env, world_size, default_addr=None, default_port=None)
    return LaunchEnv(rank, world_size, local_rank, local_world_size, addr, port, "torchrun")


def _rendezvous(
    env: Mapping[str, str], world_size: int, default_addr: str | None, default_port: int | None
) -> tuple[str, int]:
    """MASTER_ADDR / MASTER_PORT, with defaults; a world of one needs neither (loopback, a free port)."""
    addr = env.get("MASTER_ADDR") or default_addr
    if world_size == 1:
        addr = addr or LOOPBACK
    elif not addr:
        raise LaunchError(
            f"MASTER_ADDR is not set but WORLD_SIZE={world_size}: the ranks cannot find each other. Fix: set "
            f"MASTER_ADDR to the host name of the first node (rank 0), or launch with torchrun"
        )
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT", minimum=1)
        if port > 65535:
            raise LaunchError(f"MASTER_PORT={port} is not a TCP port. Fix: pick a free port in 1024..65535")
    elif default_port is not None:
        port = default_port
    elif world_size == 1:
        port = 0
    else:
        raise LaunchError(
            f"MASTER_PORT is not set but WORLD_SIZE={world_size}. Fix: set MASTER_PORT to a free port on "
            f"MASTER_ADDR={addr} (the same on every rank), or launch with torchrun"
        )
    return addr, port


# --- SLURM (one srun task per GPU) ----------------------------------------------------------------------


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    world_size = _int(env, "SLURM_NTASKS", minimum=1)
    rank = _int(env, "SLURM_PROCID", minimum=0)
    if rank >= world_size:
        raise LaunchError(
            f"SLURM_PROCID={rank} must be < SLURM_NTASKS={world_size}. Fix: start the job with srun (which sets "
            f"both) and do not export them from the batch script"
        )
    local_rank = _int(env, "SLURM_LOCALID", minimum=0)
    nodelist_var = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    if nodelist_var not in env:
        raise LaunchError(
            "SLURM_JOB_NODELIST is not set, so the first node (the rendezvous) is unknown. Fix: start the job "
            "with srun inside an allocation, or set MASTER_ADDR and launch with torchrun"
        )
    try:
        nodes = parse_nodelist(env[nodelist_var])
    except ValueError as err:
        raise LaunchError(
            f"{nodelist_var}={env[nodelist_var]!r}: {err}. Fix: pass on the value SLURM set (do not edit it), "
            f"or set MASTER_ADDR to the first node and launch with torchrun"
        ) from None
    per_node = _slurm_tasks_per_node(env, len(nodes), world_size)
    node_id = _int(env, "SLURM_NODEID", minimum=0) if "SLURM_NODEID" in env else None
    if node_id is not None and node_id >= len(nodes):
        raise LaunchError(
            f"SLURM_NODEID={node_id} but {nodelist_var} names {len(nodes)} nodes. Fix: read both from the same "
            f"srun step (do not export SLURM_* variables by hand)"
        )
    if node_id is None and len(set(per_node)) > 1:
        raise LaunchError(
            f"SLURM_NODEID is not set and the nodes run different task counts {per_node}. Fix: start the job with "
            f"srun, which sets SLURM_NODEID"
        )
    local_world_size = per_node[node_id or 0]
    if local_rank >= local_world_size:
        raise LaunchError(
            f"SLURM_LOCALID={local_rank} must be < {local_world_size}, the tasks on this node. Fix: check "
            f"srun --ntasks-per-node against the tasks started per node"
        )
    default_port = None
    if "SLURM_JOB_ID" in env:
        default_port = SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID", minimum=0) % SLURM_PORT_SPAN
    addr, port = _rendezvous(env, world_size, default_addr=nodes[0], default_port=default_port)
    return LaunchEnv(rank, world_size, local_rank, local_world_size, addr, port, "slurm")


def _slurm_tasks_per_node(env: Mapping[str, str], num_nodes: int, world_size: int) -> list[int]:
    """Tasks on each node, checked against the node count and SLURM_NTASKS."""
    names = ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    name = next((n for n in names if n in env), None)
    if name is None:
        raise LaunchError(
            "none of SLURM_NTASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE is set. Fix: start "
            "the job with srun (it sets SLURM_STEP_TASKS_PER_NODE) or pass --ntasks-per-node"
        )
    try:
        per_node = parse_tasks_per_node(env[name])
    except ValueError as err:
        raise LaunchError(
            f"{name}={env[name]!r}: {err}. Fix: pass on the value SLURM set, or use srun --ntasks-per-node=N"
        ) from None
    if len(per_node) == 1:
        per_node *= num_nodes  # --ntasks-per-node=4 is one number for every node
    if len(per_node) != num_nodes:
        raise LaunchError(
            f"{name}={env[name]!r} describes {len(per_node)} nodes but the node list has {num_nodes}. Fix: read "
            f"both from the same srun step"
        )
    if sum(per_node) != world_size:
        raise LaunchError(
            f"{name}={env[name]!r} adds up to {sum(per_node)} tasks but SLURM_NTASKS={world_size}. Fix: make "
            f"srun --ntasks equal to nodes x --ntasks-per-node"
        )
    return per_node


_HOST = re.compile(r"([^\[\],]*)(?:\[([^\[\]]*)\])?")


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list, as `scontrol show hostnames` does.

    `gpu[01-03,07],login5` -> gpu01 gpu02 gpu03 gpu07 login5; zero padding follows the range start
    (`n[098-101]` -> n098 .. n101); several bracket groups in one name multiply (`r[1-2]n[1-2]` -> r1n1 r1n2
    r2n1 r2n2). Raises ValueError for anything else (unbalanced brackets, empty names, reversed ranges).
    """
    hosts: list[str] = []
    for name in _split_top_level(nodelist.strip()):
        if not name:
            raise ValueError("empty host name (two commas in a row, or a trailing comma)")
        expanded = [""]
        pos = 0
        while pos < len(name):
            match = _HOST.match(name, pos)
            if match is None or match.end() == pos:
                raise ValueError(f"cannot parse {name!r} at position {pos} (unbalanced '[' or ']')")
            prefix, ranges = match.group(1), match.group(2)
            options = [prefix] if ranges is None else [prefix + n for n in _expand_ranges(ranges, name)]
            expanded = [head + tail for head in expanded for tail in options]
            pos = match.end()
        hosts.extend(expanded)
    if not hosts:
        raise ValueError("the node list is empty")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: `a[1,2],b` -> [`a[1,2]`, `b`]."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '[' in a host name")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return parts


def _expand_ranges(ranges: str, name: str) -> list[str]:
    """`01-03,07` -> 01 02 03 07 (width of each range start kept)."""
    numbers = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"bad range {part!r} in {name!r}: expected N or N-M with digits")
        high = high or low
        if int(high) < int(low):
            raise ValueError(f"reversed range {part!r} in {name!r}")
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's tasks-per-node list: `4(x2),3` -> [4, 4, 3]; `8` -> [8]. Raises ValueError otherwise."""
    counts: list[int] = []
    for part in spec.strip().split(","):
        match = _TASKS.match(part.strip())
        if match is None:
            raise ValueError(f"cannot parse {part!r}: expected N or N(xR), e.g. 4(x2),3")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if count < 1 or repeat < 1:
            raise ValueError(f"{part!r}: task and node counts must be >= 1")
        counts += [count] * repeat
    return counts


def _int(env: Mapping[str, str], name: str, minimum: int) -> int:
    raw = env.get(name)
    if raw is None:
        raise LaunchError(f"{name} is not set. Fix: start the job with torchrun or srun, which set it")
    try:
        value = int(raw.strip())
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer. Fix: unset it or give a whole number") from None
    if value < minimum:
        raise LaunchError(f"{name}={value} must be >= {minimum}. Fix: check how the job was started")
    return value


# --- a rank that died -----------------------------------------------------------------------------------

_PEER_GONE = (
    "connection reset",
    "connection closed",
    "broken pipe",
    "connection refused",
    "remote process exited",
)
_TIMED_OUT = ("timed out", "timeout")


def failure_note(message: str, rank: int, world_size: int, timeout_s: float, side: str = "") -> str | None:
    """What to tell the user when a collective failed with `message`; None if it does not look like one.
    `side` names the rank's part under split placement ("training", "rollout")."""
    text = message.lower()
    where = f"{side + ' ' if side else ''}rank {rank} of {world_size}"
    if any(marker in text for marker in _PEER_GONE):
        return (
            f"{where}: another rank closed its connection, so it most likely exited; the first rank that failed "
            f"has the cause in its log (look for the earliest traceback, or an OOM kill in the scheduler's log)"
        )
    if is_timeout(message) or "nccl" in text:
        return (
            f"{where}: a collective waited longer than cluster.timeout_s={timeout_s:g}s: another rank is stuck "
            f"or died without closing its connections; its log has the cause. Fix: if a phase is legitimately "
            f"slow (a large checkpoint save, first compilation), raise cluster.timeout_s"
        )
    return None


def is_timeout(message: str) -> bool:
    """Whether an error message says that a collective (or the store) timed out."""
    return any(marker in message.lower() for marker in _TIMED_OUT)


@contextmanager
def explain_rank_failures(
    rank: int, world_size: int, timeout_s: float, side: str = "", describe: Callable[[int], str] | None = None
) -> Iterator[None]:
    """Print `failure_note` for an exception that looks like a failed collective, then let it propagate.

    The note turns a bare gloo/NCCL error into 'which rank, what probably happened, what to do'. It is printed
    at once, not attached to the traceback: the launcher stops the surviving ranks within a fraction of a
    second of the first failure, often before their tracebacks (printed after teardown) get out.
    After a timeout the note also names the ranks that did not arrive (`parallel.arrival`), each with its side
    and coordinates when `describe` is given (split placement: `SplitLayout.describe_rank`); this rank then
    prints its traceback and exits at once (os._exit(1)): a teardown that waits on the missing rank would
    only delay the launcher's stop of the job.
    """
    try:
        yield
    except Exception as err:
        note = failure_note(str(err), rank, world_size, timeout_s, side) if world_size > 1 else None
        if note and is_timeout(str(err)):
            from parallel.arrival import report_missing_ranks

            print(
                f"{note}.{report_missing_ranks(rank, world_size, describe=describe)}",
                file=sys.stderr,
                flush=True,
            )
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if note:
            print(note, file=sys.stderr, flush=True)
        raise
