"""Which ranks did not arrive: after a collective timed out, the live ranks report through the rendezvous
store and name the ones that stayed silent.

A timed-out collective says only that some rank is late. At start-up every rank publishes its host and
process ids in the store (`publish_process`). A rank whose collective times out writes its arrival key,
waits up to `REPORT_GRACE_S` for the keys of the others, and names the ranks whose key is missing
(`report_missing_ranks`). Under torchrun, a missing rank on this host under the same agent is killed: the
agent's teardown sends SIGTERM and waits 30 s before SIGKILL, and a stopped process (SIGSTOP, a debugger)
does not act on SIGTERM. The store is torchrun's agent store, or rank 0's for other launchers; when it
cannot be reached the report says so instead of naming ranks.

Uses the default process group's store only (no collective can work once a rank is missing).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time
from collections.abc import Callable

import torch.distributed as dist

REPORT_GRACE_S = 3.0
"""Seconds a rank whose collective timed out waits for the other ranks' reports."""
_POLL_S = 0.1


def _key(kind: str, rank: int) -> str:
    # torchrun may restart the workers: keys of an earlier attempt must not count
    return f"engine_arrival/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{kind}/{rank}"


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def publish_process(rank: int) -> None:
    """Record this rank's host, pid and parent pid in the store (read by a rank that finds it missing)."""
    _store().set(_key("process", rank), f"{socket.gethostname()} {os.getpid()} {os.getppid()}")


def missing_ranks(rank: int, world_size: int, grace_s: float = REPORT_GRACE_S) -> list[int]:
    """Report this rank's arrival; return the ranks that did not report within `grace_s` (sorted)."""
    store = _store()
    store.set_timeout(datetime.timedelta(seconds=grace_s + 2.0))  # a stopped store host must not hang us
    store.set(_key("arrived", rank), "1")
    keys = [_key("arrived", r) for r in range(world_size)]
    deadline = time.monotonic() + grace_s
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return [r for r, key in enumerate(keys) if not store.check([key])]


def kill_local_peers(ranks: list[int]) -> list[int]:
    """SIGKILL those of `ranks` that run on this host under this process's parent (the torchrun agent).

    Only under torchrun, which would SIGKILL them itself after its 30 s grace. Returns the ranks killed.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return []
    store, killed = _store(), []
    host, parent = socket.gethostname(), os.getppid()
    for rank in ranks:
        try:
            their_host, pid, their_parent = store.get(_key("process", rank)).decode().split()
        except Exception:  # not published or unreadable: leave it to the launcher
            continue
        if their_host == host and int(their_parent) == parent and _parent_of(int(pid)) == parent:
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(rank)
            except OSError:
                pass
    return killed


def _parent_of(pid: int) -> int | None:
    """Parent pid of a live process (Linux /proc), None if unknown: guards against a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def report_missing_ranks(
    rank: int, world_size: int, grace_s: float = REPORT_GRACE_S, describe: Callable[[int], str] | None = None
) -> str:
    """One or two sentences for the timeout note: which ranks did not arrive, and which were stopped here.
    `describe` names a rank's side and coordinates (split placement: `SplitLayout.describe_rank`)."""
    try:
        missing = missing_ranks(rank, world_size, grace_s)
    except Exception as err:  # the store itself is gone or stuck (its host is the stuck rank)
        return (
            f" The rendezvous store did not answer either ({type(err).__name__}), so the rank that hosts it "
            f"(rank 0 unless torchrun hosts it) is probably the stuck one."
        )
    if not missing:
        return (
            f" Every rank reported within {grace_s:g}s of this timeout: none is stopped; they wait in different "
            f"collectives (a code path that only some ranks take) or a message was lost."
        )
    named = f" ({'; '.join(describe(r) for r in missing)})" if describe is not None else ""
    text = (
        f" Rank(s) {missing} did not arrive{named}: no report from them within {grace_s:g}s of this timeout "
        f"(stopped, stuck, or still in a slow phase); their logs and stacks (py-spy dump --pid) show where."
    )
    killed = kill_local_peers(missing)
    if killed:
        text += f" Killed rank(s) {killed} on this host so that torchrun ends the job now."
    return text
