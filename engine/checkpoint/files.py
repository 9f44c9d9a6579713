"""Writing checkpoint files safely: each file flushed and fsynced, a checkpoint published by renaming its
temporary directory and replacing `latest` atomically, and a full disk reported with the device, the file and
the space needed."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch

from engine.checkpoint.store import LATEST_FILE
from engine.errors import CheckpointError


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_nbytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state: about what torch.save writes for it."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    return 0


def human_size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def _filesystem(path: str) -> str:
    """The device and mount point that hold `path` (the mount point alone where /proc/mounts is unreadable)."""
    mount = os.path.abspath(path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    device = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 1 and fields[1] == mount:
                    device = fields[0]  # the last mount on a point is the visible one
    except OSError:
        pass
    return f"{device} (mounted at {mount})" if device else mount


def _disk_full(err: BaseException, directory: str, need: int) -> bool:
    """Whether a failed write ran out of space: ENOSPC/EDQUOT anywhere in the exception chain, or a bare
    error from torch's archive writer with less free space left than the file needs."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return isinstance(err, RuntimeError) and shutil.disk_usage(directory).free < need
    except OSError:
        return False


def write_file(path: str, write: Callable[[Any], None], need: int, binary: bool = True) -> None:
    """Write `path` through `write(file)` and fsync it; running out of space raises a CheckpointError that
    names the device, the file and how much it needs."""
    try:
        with open(path, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as err:
        directory = os.path.dirname(path)
        if not _disk_full(err, directory, need):
            raise
        try:
            free = f" ({human_size(shutil.disk_usage(directory).free)} free there)"
        except OSError:
            free = ""
        raise CheckpointError(
            f"no space left on {_filesystem(directory)} writing {path}: this file needs about {human_size(need)}"
            f"{free}. Fix: free space there, or set trainer.output_dir on a larger filesystem, or keep fewer "
            f"checkpoints (trainer.max_checkpoints; while one is written the previous ones stay)"
        ) from err


def write_rank_file(path: str, state: Mapping[str, Any]) -> None:
    write_file(path, lambda f: torch.save(state, f), state_nbytes(state))


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def point_latest(root: str, checkpoint: str) -> None:
    """Make `root`'s `latest` file name `checkpoint` (a directory in `root`), atomically."""
    write_text_atomic(os.path.join(root, LATEST_FILE), os.path.basename(os.path.normpath(checkpoint)) + "\n")


def publish(root: str, tmp: str, final: str) -> None:
    """Rename the complete temporary directory to its final name, then point `latest` at it."""
    old = None
    if os.path.exists(final):  # the same step saved before (a resumed run passing it again)
        old = f"{final}.old-{secrets.token_hex(6)}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    point_latest(root, final)
    if old:
        shutil.rmtree(old, ignore_errors=True)
