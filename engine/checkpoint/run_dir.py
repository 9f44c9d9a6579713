"""One run per output directory: the lock that keeps a second run out of `trainer.output_dir`, and the
decision whether a run may start there (fresh or resuming), taken before anything is written into it.

- The lock is `<output_dir>/run.lock` (JSON: host, pid, start time), created exclusively by global rank 0.
  A lock whose pid is dead on this host is stale (a killed run) and is taken over with a message; a lock
  of a live process, or of another host (whose processes cannot be checked from here), refuses the start.
  It is removed when the run ends (a SIGKILL leaves it behind: the next run takes it over as stale).
- A fresh run (`trainer.resume=off`, or `trainer.resume=auto` finding no checkpoint) in a directory that
  holds an earlier run's metrics.jsonl or checkpoints is refused; with `trainer.overwrite=true` those outputs
  are removed first. With `trainer.resume=auto` and checkpoints of which none is usable,
  `trainer.overwrite=true` starts fresh the same way (without it engine/checkpoint/checkpoint.py refuses,
  naming every unusable checkpoint).

What this module must not do: read or write checkpoint contents (engine/checkpoint/checkpoint.py does), or touch a
directory it does not hold the lock of.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from engine.checkpoint.store import CHECKPOINTS_DIR, latest_checkpoint
from engine.errors import CheckpointError, UserError

if TYPE_CHECKING:
    from engine.config import TrainerConfig
    from parallel.state import ProcessGroups

LOCK_FILE = "run.lock"
METRICS_FILE = "metrics.jsonl"
# what an earlier run leaves that a fresh run would mix with its own (embedded/ data is rebuilt identically;
# profile/: engine/step_profiler.py's traces)
RUN_OUTPUTS = (METRICS_FILE, CHECKPOINTS_DIR, "tensorboard", "hf_actor", "profile")


class OutputDirError(UserError, RuntimeError):
    """trainer.output_dir cannot be used by this run; the message names the directory, why, and the fixes."""


def _print(text: str) -> None:
    print(text, flush=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


class RunLock:
    """The exclusive claim of one process on an output directory (`acquire`, then `release`)."""

    def __init__(self, path: str, token: str):
        self.path = path
        self.token = token

    @classmethod
    def acquire(cls, output_dir: str, say: Callable[[str], None] = _print) -> RunLock:
        """Create `<output_dir>/run.lock` for this process; take over a stale one (its pid dead on this
        host) with a message; raise OutputDirError while another run holds it."""
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, LOCK_FILE)
        token = secrets.token_hex(8)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "token": token}
        for _ in range(5):  # a race with another starter taking over the same stale lock: look again
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_lock(path)
                if holder is None:  # removed in between, or being written: look again
                    time.sleep(0.05)
                    continue
                _refuse_or_take_over(path, holder, say)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            return cls(path, token)
        raise OutputDirError(f"could not create the lock file {path} (other runs keep starting there)")

    def release(self) -> None:
        """Remove the lock file if it is still this process's."""
        holder = _read_lock(self.path)
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


def _read_lock(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: treated as held by an unknown process


def _refuse_or_take_over(path: str, holder: dict, say: Callable[[str], None]) -> None:
    host, pid = holder.get("host"), holder.get("pid")
    here = socket.gethostname()
    started = holder.get("started")
    since = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) if started else ""
    output_dir = os.path.dirname(path)
    if host == here and isinstance(pid, int) and not _pid_alive(pid):
        stale = f"{path}.stale-{secrets.token_hex(4)}"
        with contextlib.suppress(FileNotFoundError):  # another starter took it over first
            os.rename(path, stale)
            os.remove(stale)
            say(f"run dir: taking over the stale lock {path} of pid {pid} on {host}{since} (no such process)")
        return
    who = f"pid {pid} on host {host}{since}" if host else "an unknown process (the lock file is unreadable)"
    check = "" if host == here else f" (from {here} its process cannot be checked)"
    raise OutputDirError(
        f"trainer.output_dir={output_dir} is in use by another run: {who}{check}, lock file {path}. "
        f"Two runs in one directory mix their metrics and checkpoints. Fix: wait for that run to end, or "
        f"give this run another trainer.output_dir; if that run no longer exists, delete {path}"
    )


def _earlier_outputs(output_dir: str) -> list[str]:
    """What an earlier run left in output_dir: metrics.jsonl with lines, a checkpoints/ with anything."""
    found = []
    metrics = os.path.join(output_dir, METRICS_FILE)
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append(metrics)
    ckpts = os.path.join(output_dir, CHECKPOINTS_DIR)
    if os.path.isdir(ckpts) and os.listdir(ckpts):
        found.append(ckpts)
    return found


def _remove_outputs(output_dir: str, why: str, say: Callable[[str], None]) -> None:
    removed = []
    for name in RUN_OUTPUTS:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        else:
            continue
        removed.append(name)
    if removed:
        say(f"run dir: trainer.overwrite=true ({why}): removed {', '.join(removed)} from {output_dir}")


def prepare_output_dir(output_dir: str, t: TrainerConfig, say: Callable[[str], None] = _print) -> None:
    """Decide whether this run may start in `output_dir` (see the module docstring); with
    trainer.overwrite=true remove an earlier run's outputs when this run starts fresh."""
    if t.resume == "off":
        found = _earlier_outputs(output_dir)
        if not found:
            return
        if t.overwrite:
            _remove_outputs(output_dir, "a fresh run, trainer.resume=off", say)
            return
        raise OutputDirError(
            f"trainer.output_dir={output_dir} holds an earlier run's outputs ({', '.join(found)}) and "
            f"trainer.resume=off starts a fresh run, which would mix its metrics and checkpoints with "
            f"them. Fix: continue that run with trainer.resume=auto; or start fresh in a new "
            f"trainer.output_dir, or here with trainer.overwrite=true (removes them)"
        )
    if t.resume != "auto":
        return
    try:
        found_checkpoint = latest_checkpoint(os.path.join(output_dir, CHECKPOINTS_DIR))
    except CheckpointError as err:  # none usable: start fresh if asked (else checkpoint.py refuses)
        if t.overwrite:
            _remove_outputs(output_dir, f"no usable checkpoint to resume: {err}", say)
        return
    found = [] if found_checkpoint is not None else _earlier_outputs(output_dir)
    if not found:
        return
    if t.overwrite:
        _remove_outputs(output_dir, "trainer.resume=auto found no checkpoint to resume", say)
        return
    raise OutputDirError(
        f"trainer.output_dir={output_dir} holds an earlier run's outputs ({', '.join(found)}) but no "
        f"checkpoint, so trainer.resume=auto would start a fresh run and overwrite that run's metrics (it "
        f"saved none: trainer.save_freq=0, or it stopped before its first save). Fix: start fresh in a new "
        f"trainer.output_dir, or here with trainer.overwrite=true (removes them); or resume a checkpoint kept "
        f"elsewhere with trainer.resume=PATH"
    )


@contextlib.contextmanager
def claimed_output_dir(output_dir: str, t: TrainerConfig, groups: ProcessGroups) -> Iterator[None]:
    """Hold the lock on `output_dir` (global rank 0) and check that this run may start there, for the
    duration of the block; collective: every rank raises the same OutputDirError if it may not."""
    with claimed_output_dir_over(
        output_dir, t, groups.rank, groups.dims.world_size, groups.world, groups.device
    ):
        yield


@contextlib.contextmanager
def claimed_output_dir_over(
    output_dir: str, t: TrainerConfig, rank: int, world_size: int, group, device
) -> Iterator[None]:
    """`claimed_output_dir` with the ranks that learn the decision given as `group` (of `world_size` ranks,
    global rank 0 among them): split placement's rollout ranks hold no training `ProcessGroups`."""
    import torch.distributed as dist

    lock = None
    box: list[str | None] = [None]
    if rank == 0:
        try:
            lock = RunLock.acquire(output_dir)
            prepare_output_dir(output_dir, t)
        except Exception as err:  # every rank must learn it, or the others wait in the broadcast below
            box[0] = str(err) if isinstance(err, OutputDirError) else f"{output_dir}: {err!r}"
            if lock is not None:
                lock.release()
    if world_size > 1:
        dist.broadcast_object_list(box, src=0, group=group, device=device)
    if box[0] is not None:
        raise OutputDirError(box[0])
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
