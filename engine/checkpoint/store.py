"""Checkpoints on disk: their names (`<output_dir>/checkpoints/global_step_<N>/`, `latest`), which of them are
complete and usable, pruning, and reading one back with errors that name the file and the checkpoint to fall
back to. Reads only: writing is engine/checkpoint/files.py, what a checkpoint holds engine/checkpoint/checkpoint.py."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import zipfile
from typing import Any

import torch

from engine.errors import CheckpointError

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_STALE_DIR = re.compile(r"^global_step_\d+\.(tmp|old)-[0-9a-f]+$")


def step_dir_name(step: int) -> str:
    return f"global_step_{step}"


def rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank_{rank}.pt")


# ---- layout ------------------------------------------------------------------------------------------


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints under `root` (named global_step_<N>, with meta.json), by step."""
    if not os.path.isdir(root):
        return []
    found = []
    for entry in os.listdir(root):
        match = _STEP_DIR.match(entry)
        if match and os.path.isfile(os.path.join(root, entry, META_FILE)):
            found.append((int(match.group(1)), os.path.join(root, entry)))
    return sorted(found)


def prune_checkpoints(root: str, max_checkpoints: int, keep: str) -> None:
    """Remove leftover temporary directories and all but the `max_checkpoints` newest complete checkpoints
    (0 = keep all); `keep` (the one just saved, which `latest` names) always stays."""
    for entry in os.listdir(root):
        if _STALE_DIR.match(entry):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    if max_checkpoints <= 0:
        return
    others = [p for _, p in complete_checkpoints(root) if os.path.basename(p) != keep]
    for path in others[: max(len(others) - (max_checkpoints - 1), 0)]:
        shutil.rmtree(path, ignore_errors=True)


# ---- finding and reading ---------------------------------------------------------------------------------


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint directory `path` cannot be resumed, found cheaply (meta.json readable and of this
    format; every rank's file present and a complete archive: its end record is read, not the tensors; the
    critic ranks' files after the actor's where the critic had ranks of its own); None if it looks usable."""
    file = os.path.join(path, META_FILE)
    if not os.path.isfile(file):
        return f"{META_FILE} is missing (the save did not complete)"
    try:
        with open(file) as f:
            meta = json.load(f)
        layout = meta["layout"]
        world = int(layout["world_size"]) + int(layout.get("critic_ranks", {}).get("world_size", 0))
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{META_FILE} is unreadable, truncated or incomplete ({type(err).__name__}: {err})"
    if meta.get("format") != FORMAT_VERSION:
        return f"{META_FILE} has format {meta.get('format')!r}, this engine reads {FORMAT_VERSION}"
    for rank in range(world):
        shard = rank_file(path, rank)
        if not os.path.isfile(shard):
            return f"{os.path.basename(shard)} is missing (saved by {world} ranks)"
        if not zipfile.is_zipfile(shard):
            return f"{os.path.basename(shard)} is truncated or corrupt (not a complete torch archive)"
    return None


def _step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, path) of every global_step_<N> directory under `root`, complete or not, by step."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, e)) for e in os.listdir(root) if (m := _STEP_DIR.match(e))]
    return sorted(found)


def latest_checkpoint(root: str, skipped: list[str] | None = None) -> str | None:
    """The checkpoint `root/latest` names, else (that file missing or naming nothing) the highest-numbered
    one; an unusable one (`checkpoint_problem`) is skipped for the next older one, with a note appended to
    `skipped`. None if `root` holds no checkpoint directory; CheckpointError naming each one and why if
    none of them is usable."""
    paths = [p for _, p in _step_dirs(root)]
    latest = os.path.join(root, LATEST_FILE)
    if os.path.isfile(latest):
        with open(latest) as f:
            named = os.path.join(root, f.read().strip())
        if named in paths:  # higher steps are left over from before a resume from an older checkpoint
            paths = paths[: paths.index(named) + 1]
    problems = []
    for path in reversed(paths):
        why = checkpoint_problem(path)
        if why is None:
            if skipped is not None:
                skipped.extend(f"skipped {p}: {w}" for p, w in problems)
            return path
        problems.append((path, why))
    if not problems:
        return None
    raise CheckpointError(
        f"no usable checkpoint in {root}: "
        + "; ".join(f"{p}: {w}" for p, w in problems)
        + ". Fix: resume from a good checkpoint elsewhere with trainer.resume=PATH; or start fresh in a "
        "new trainer.output_dir, or here with trainer.overwrite=true (removes them and metrics.jsonl)"
    )


def _previous_checkpoint(path: str) -> str:
    """A fix for an unreadable checkpoint: resume from the newest usable one before it, if there is one."""
    root, name = os.path.split(os.path.normpath(path))
    match = _STEP_DIR.match(name)
    if match:
        older = [p for s, p in _step_dirs(root) if s < int(match.group(1))]
        for other in reversed(older):
            if checkpoint_problem(other) is None:
                return f"Fix: resume from the previous complete checkpoint, trainer.resume={other}"
    return "Fix: resume from another checkpoint (trainer.resume=PATH), or start fresh without it"


def find_checkpoint(resume: str, output_dir: str, skipped: list[str] | None = None) -> str | None:
    """The checkpoint directory `trainer.resume` asks for: None for `off`, or for `auto` when output_dir
    has none; a path may name a checkpoint, a checkpoints directory or a run's output_dir. Notes on
    checkpoints passed over as unusable are appended to `skipped`."""
    if resume == "off":
        return None
    if resume == "auto":
        return latest_checkpoint(os.path.join(output_dir, CHECKPOINTS_DIR), skipped)
    if os.path.isfile(os.path.join(resume, META_FILE)):
        return resume
    for root in (resume, os.path.join(resume, CHECKPOINTS_DIR)):
        if os.path.isfile(os.path.join(root, LATEST_FILE)):
            found = latest_checkpoint(root, skipped)
            if found:
                return found
    raise CheckpointError(
        f"trainer.resume={resume!r}: not a checkpoint (no {META_FILE}) and no {LATEST_FILE} file in it or in "
        f"its {CHECKPOINTS_DIR}/. Fix: point it at a global_step_<N> directory, or use trainer.resume=auto"
    )


def newer_checkpoints(path: str, output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the global_step_<N> directories after checkpoint `path` in output_dir's checkpoints,
    when `path` is one of them and `resume=auto` there would take a newer one than `path` (resuming from
    `path` would then branch off that history); else []."""
    root = os.path.join(output_dir, CHECKPOINTS_DIR)
    match = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if not match or os.path.realpath(os.path.dirname(os.path.normpath(path))) != os.path.realpath(root):
        return []
    step = int(match.group(1))
    try:
        latest = latest_checkpoint(root)
    except CheckpointError:  # none usable: nothing resume=auto could take instead
        return []
    latest_match = _STEP_DIR.match(os.path.basename(latest)) if latest else None
    if latest_match is None or int(latest_match.group(1)) <= step:
        return []
    return [(s, p) for s, p in _step_dirs(root) if s > step]


def read_meta(path: str) -> dict[str, Any]:
    file = os.path.join(path, META_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} is not a checkpoint: {META_FILE} is missing")
    try:
        with open(file) as f:
            meta = json.load(f)
    except ValueError as err:
        raise CheckpointError(
            f"{file} is truncated or corrupt ({err}): checkpoint {path} cannot be read. "
            + _previous_checkpoint(path)
        ) from err
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: checkpoint format {meta.get('format')!r}, this engine reads {FORMAT_VERSION}"
        )
    return meta


def read_rank_state(path: str, rank: int, mmap: bool = False) -> dict[str, Any]:
    """This rank's saved state (host tensors); `mmap` reads tensors lazily from the file."""
    file = rank_file(path, rank)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete or was saved by fewer ranks")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, pickle.UnpicklingError) as err:
        raise CheckpointError(
            f"{file} is truncated or corrupt ({type(err).__name__}: {str(err).splitlines()[0]}): checkpoint "
            f"{path} cannot be read. " + _previous_checkpoint(path)
        ) from err
