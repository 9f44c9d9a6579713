"""Checkpoints of a training run: save every `trainer.save_freq` steps (and after the last step), resume with
`trainer.resume` (`auto` | `off` | a path), keep the last `trainer.max_checkpoints`.

On disk, under `<trainer.output_dir>/checkpoints/`:
    global_step_<N>/rank_<r>.pt   what rank r needs to continue: its shards of every trainable role (parameters
                                  by global name, optimizer state, LR schedule), data position, RNG states, the
                                  step and the trainer's extra state (e.g. a KL controller)
    global_step_<N>/meta.json     step, layout, the resolved model config, the run's whole config, what an HF
                                  export needs
    latest                        one line: the name of the newest complete checkpoint
A save is atomic: every rank writes into `global_step_<N>.tmp-<random>/`, the ranks agree that all writes
succeeded, then rank 0 renames the directory and replaces `latest` (written to a temporary file and
`os.replace`d). A crash or a failing rank mid-save leaves `latest` and the checkpoint it names untouched;
leftover temporary directories are never read and are removed by the next successful save. A save that
runs out of disk space says so, naming the device, the file and the size needed.

`trainer.resume=auto` takes the checkpoint `latest` names if it is usable (meta.json readable, every rank's
file a complete archive), else the next older usable one, saying which it skipped and why; if checkpoints
exist but none is usable it stops, naming each (engine/checkpoint/run_dir.py starts fresh instead with
trainer.overwrite=true). A truncated file met while loading is named with its checkpoint and the previous
complete checkpoint to resume from.

What one rank's state holds, and how it goes back into the live objects, is engine/checkpoint/checkpoint_state.py.

What this module must not do: reshard. A checkpoint resumes only under the layout it was saved with (tp, pp,
vpp, first/last stage layers where set, dp, world size, distributed optimizer); anything else is refused with
a message pointing at the way to change layout: export to Hugging Face (`python -m engine.export`) and start a
new run from it (`model.path`). The automatic stage split (parallel/layout.py) is part of the format: a
checkpoint of an uneven split resumes only under the same rule.
Multi-node runs need `trainer.output_dir` on a filesystem every rank sees (rank 0 renames what all wrote).
The reference policy is not saved: it is rebuilt from `model.path` (or the seeded init) exactly as at start.
A resumed run follows its own config, not the saved one (LR schedule, Adam settings, trainer.total_steps: see
`load_role_state`); the resume message lists every config key whose value differs from the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import re
import secrets
import shutil
import time
import zipfile
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from engine.checkpoint.checkpoint_state import (
    CheckpointError,
    cpu_copy,
    load_role_state,
    rng_state,
    role_state_dict,
    set_rng_state,
)
from engine.config import ModelConfig
from engine.models.builder import ModelShape
from engine.roles.offload import all_onloaded
from engine.roles.policy import MegatronRole
from parallel.state import ProcessGroups

if TYPE_CHECKING:  # engine.setup builds everything; importing it here at run time is not needed
    from engine.setup import Components


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
def run_layout(groups: ProcessGroups, distributed_optimizer: bool) -> dict[str, Any]:
    """What must be equal for a per-rank checkpoint to resume: the shard layout of parameters and optimizer."""
    d = groups.dims
    return {
        "world_size": d.world_size,
        "tp": d.tp,
        "pp": d.pp,
        "vpp": d.vpp,
        "dp": d.dp,
        "distributed_optimizer": bool(distributed_optimizer),
        # only when set, so that checkpoints of the automatic split keep the layout they were saved with
        **{k: getattr(d, k) for k in ("first_stage_layers", "last_stage_layers") if getattr(d, k)},
    }


def _describe(layout: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items())


def check_layout(saved: Mapping[str, Any], now: Mapping[str, Any], path: str) -> None:
    """Raise CheckpointError if the checkpoint at `path` was saved under another layout than this run's."""
    differ = [k for k in now if saved.get(k) != now[k]]
    if not differ:
        return
    world = saved.get("world_size", "?")
    raise CheckpointError(
        f"cannot resume from {path}: it was saved with {_describe(saved)}, this run has {_describe(now)} "
        f"(differs in {', '.join(differ)}). A checkpoint holds per-rank shards and is not resharded across "
        f"layouts. Fix: resume with the saved parallel.tp/pp/vpp, optim.distributed_optimizer and "
        f"{world} ranks; or, to change layout, export it to Hugging Face (torchrun --nproc_per_node={world} "
        f"-m engine.export {path} OUT_DIR) and start a new run with model.path=OUT_DIR (the optimizer state "
        f"and data position start fresh)"
    )


def shape_fields(shape: ModelShape) -> dict[str, Any]:
    """ModelShape as JSON-friendly values (dtype by name)."""
    out = dataclasses.asdict(shape)
    out["dtype"] = str(shape.dtype).removeprefix("torch.")
    return out


def resolved_model_config(model: ModelConfig, shape: ModelShape) -> ModelConfig:
    """The model config with every architecture field as built (from model.path's config.json and the
    tokenizer's vocabulary too): enough to rebuild the same chunks without the source checkpoint."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    arch = {k: v for k, v in shape_fields(shape).items() if k in fields}
    return dataclasses.replace(model, **arch)


def flat_config(cfg: Any) -> dict[str, Any]:
    """A config dataclass as {dotted key: value}, values as JSON reads them back (tuples become lists)."""

    def walk(prefix: str, node: Any, out: dict[str, Any]) -> dict[str, Any]:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(f"{prefix}{key}.", value, out)
            else:
                out[f"{prefix}{key}"] = value
        return out

    return walk("", json.loads(json.dumps(dataclasses.asdict(cfg))), {})


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """`key: saved -> now` for every key whose value differs between two flat configs, sorted by key."""
    missing = "(absent)"
    return [
        f"{key}: {saved.get(key, missing)!r} -> {now.get(key, missing)!r}"
        for key in sorted(saved.keys() | now.keys())
        if saved.get(key, missing) != now.get(key, missing)
    ]


def check_shape(saved: Mapping[str, Any], shape: ModelShape, path: str) -> None:
    now = shape_fields(shape)
    differ = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if differ:
        raise CheckpointError(
            f"cannot resume from {path}: the model differs from the checkpoint's ((saved, now): {differ}). "
            f"Fix: resume with the same model.* settings (and model.path) as the run that saved it"
        )


# ---- atomic save ---------------------------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
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


def _size(nbytes: float) -> str:
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


def _write_file(path: str, write: Callable[[Any], None], need: int, binary: bool = True) -> None:
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
            free = f" ({_size(shutil.disk_usage(directory).free)} free there)"
        except OSError:
            free = ""
        raise CheckpointError(
            f"no space left on {_filesystem(directory)} writing {path}: this file needs about {_size(need)}"
            f"{free}. Fix: free space there, or set trainer.output_dir on a larger filesystem, or keep fewer "
            f"checkpoints (trainer.max_checkpoints; while one is written the previous ones stay)"
        ) from err


def _write_rank_file(path: str, state: Mapping[str, Any]) -> None:
    _write_file(path, lambda f: torch.save(state, f), state_nbytes(state))


def _write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _failed_ranks(ok: bool, groups: ProcessGroups) -> list[int]:
    """Every rank learns which ranks failed (a collective: all ranks call it)."""
    flags = torch.zeros(groups.dims.world_size, dtype=torch.int32, device=groups.device)
    flags[groups.rank] = 0 if ok else 1
    dist.all_reduce(flags, group=groups.world)
    return [r for r, f in enumerate(flags.tolist()) if f]


def save_checkpoint(
    root: str,
    step: int,
    state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    meta: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    groups: ProcessGroups,
    max_checkpoints: int,
) -> str:
    """Write this rank's `state` (and rank 0's `meta`) as `root/global_step_<step>`, atomically; point
    `latest` at it and prune to `max_checkpoints` (0 = keep all). Collective over all ranks; returns the
    path. Raises CheckpointError on every rank if any rank failed (also while building `state` or `meta`
    when given as callables); `latest` then still names the previous checkpoint.
    """
    name = step_dir_name(step)
    box = [f"{name}.tmp-{secrets.token_hex(6)}" if groups.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=groups.world, device=groups.device)
    tmp = os.path.join(root, box[0])
    error: BaseException | None = None
    nbytes = 0
    try:
        os.makedirs(tmp, exist_ok=True)
        rank_state = state() if callable(state) else state
        nbytes = state_nbytes(rank_state)
        _write_rank_file(rank_file(tmp, groups.rank), rank_state)
        if groups.rank == 0:
            meta = meta() if callable(meta) else meta
            text = json.dumps({**meta, "step": step, "format": FORMAT_VERSION}, indent=2)
            _write_file(os.path.join(tmp, META_FILE), lambda f: f.write(text), len(text), binary=False)
    except Exception as err:  # every rank must reach the agreement below, whatever failed
        error = err
    failed = _failed_ranks(error is None, groups)
    final = os.path.join(root, name)
    if not failed:  # all wrote: rank 0 publishes, and everyone learns whether that worked
        if groups.rank == 0:
            try:
                _publish(root, tmp, final)
            except Exception as err:
                error = err
        failed = _failed_ranks(error is None, groups)
    if failed:
        if groups.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        sizes = torch.tensor([float(nbytes)], dtype=torch.float64, device=groups.device)
        dist.all_reduce(sizes, group=groups.world)  # every rank is here: all saw the same `failed`
        raise CheckpointError(
            f"saving checkpoint {final} failed on rank(s) {failed}"
            + (f" (here: {type(error).__name__}: {error})" if error else "")
            + f"; {os.path.join(root, LATEST_FILE)} still names the previous checkpoint. The checkpoint "
            f"needs about {_size(sizes.item())} (all ranks' files)"
        ) from error
    if groups.rank == 0:
        prune_checkpoints(root, max_checkpoints, keep=name)
    dist.barrier(group=groups.world)
    return final


def _publish(root: str, tmp: str, final: str) -> None:
    """Rename the complete temporary directory to its final name, then point `latest` at it."""
    old = None
    if os.path.exists(final):  # the same step saved before (a resumed run passing it again)
        old = f"{final}.old-{secrets.token_hex(6)}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_text_atomic(os.path.join(root, LATEST_FILE), os.path.basename(final) + "\n")
    if old:
        shutil.rmtree(old, ignore_errors=True)


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
    format; every rank's file present and a complete archive: its end record is read, not the tensors);
    None if it looks usable."""
    file = os.path.join(path, META_FILE)
    if not os.path.isfile(file):
        return f"{META_FILE} is missing (the save did not complete)"
    try:
        with open(file) as f:
            meta = json.load(f)
        world = int(meta["layout"]["world_size"])
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


def tokenizer_dir_of(c: Components) -> str:
    """The tokenizer directory of components `c` (absolute; empty if unknown), copied into HF exports."""
    tok = c.cfg.model.tokenizer_path or c.cfg.model.path or getattr(c.tokenizer, "name_or_path", "")
    return os.path.abspath(tok) if tok and os.path.isdir(tok) else ""


# ---- the run-level saver the trainer calls -----------------------------------------------------------------
class Checkpointer:
    """Saves and resumes a run built by engine/setup.py: every trainable role (actor, and critic when the
    components have one), the data position, RNG states, the step and `stateful` objects of the trainer
    (anything with state_dict/load_state_dict, e.g. a KL controller)."""

    def __init__(self, c: Components, stateful: Mapping[str, Any] | None = None):
        self.c = c
        self.t = c.cfg.trainer
        self.groups: ProcessGroups = c.groups
        self.root = os.path.join(c.output_dir, CHECKPOINTS_DIR)
        self.roles: dict[str, MegatronRole] = {
            name: role
            for name in ("actor", "critic")
            if (role := getattr(c, name, None)) is not None and role.trainable
        }
        self.stateful = dict(stateful or {})
        self.layout = run_layout(self.groups, c.cfg.optim.distributed_optimizer)
        self.saved_step: int | None = None

    def _say(self, text: str) -> None:
        if self.groups.is_logging_rank:
            print(f"checkpoint: {text}", flush=True)

    def resume(self) -> int:
        """Load the checkpoint `trainer.resume` names (if any) into the live components; the step to
        continue from (0 = a fresh start)."""
        g = self.groups
        # rank 0 decides which checkpoint (one view of the filesystem), every rank loads its own file, and
        # all ranks fail together if any failed (a lone failing rank would leave the others in a collective)
        box: list[Any] = [None]
        if g.rank == 0:
            skipped: list[str] = []
            try:
                box[0] = ("ok", find_checkpoint(self.t.resume, self.c.output_dir, skipped))
            except CheckpointError as err:
                box[0] = ("error", str(err))
            for note in skipped:
                self._say(note)
        dist.broadcast_object_list(box, src=0, group=g.world, device=g.device)
        kind, path = box[0]
        if kind == "error":
            raise CheckpointError(path)
        if path is None:
            if self.t.resume == "auto":
                self._say(f"trainer.resume=auto: no checkpoint in {self.root}; starting fresh")
            return 0
        error: BaseException | None = None
        try:
            step = self._load(path)
        except Exception as err:
            error = err
        failed = _failed_ranks(error is None, g)
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(f"resuming from {path} failed on rank(s) {failed} (see their messages)")
        self.saved_step = step
        self._say(f"resumed from {path} at step {step}")
        self._say_config_changes(path)
        return step

    def _say_config_changes(self, path: str) -> None:
        if not self.groups.is_logging_rank:
            return
        saved = read_meta(path).get("config")
        if saved is None:
            self._say("the checkpoint stores no config to compare this run's with")
            return
        changes = config_changes(saved, flat_config(self.c.cfg))
        self._say(
            f"{len(changes)} config key(s) differ from the checkpoint's; this run uses its own values"
            + "".join(f"\n  {line}" for line in changes)
        )

    def _load(self, path: str) -> int:
        meta = read_meta(path)
        check_layout(meta["layout"], self.layout, path)
        check_shape(meta["shape"], self.c.shape, path)
        state = read_rank_state(path, self.groups.rank)
        where = rank_file(path, self.groups.rank)
        for name, role in self.roles.items():
            if name not in state["roles"]:
                raise CheckpointError(f"{where} has no {name} state (it holds {sorted(state['roles'])})")
            with all_onloaded(role):
                load_role_state(role, state["roles"][name], where)
        self.c.loader.load_state_dict(state["loader"])
        for name, obj in self.stateful.items():
            if name not in state["extra"]:
                raise CheckpointError(
                    f"{where} has no trainer state {name!r} (it holds {sorted(state['extra'])})"
                )
            obj.load_state_dict(state["extra"][name])
        set_rng_state(state["rng"], self.groups.device)
        return state["step"]

    def _meta(self) -> dict[str, Any]:
        c = self.c
        tok = c.tokenizer
        source = None
        if c.cfg.model.path:
            from engine.models.hf_config import read_hf_config

            source = read_hf_config(c.cfg.model.path)
        return {
            "layout": self.layout,
            "roles": sorted(self.roles),
            "shape": shape_fields(c.shape),
            "model": dataclasses.asdict(resolved_model_config(c.cfg.model, c.shape)),
            "config": flat_config(c.cfg),
            "source_hf_config": source,
            "tokenizer_dir": tokenizer_dir_of(c),
            "special_token_ids": {
                key: getattr(tok, key, None) for key in ("bos_token_id", "eos_token_id", "pad_token_id")
            },
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }

    def _state(self, step: int) -> dict[str, Any]:
        roles = {}
        for name, role in self.roles.items():
            with all_onloaded(role):
                roles[name] = role_state_dict(role)
        return {
            "format": FORMAT_VERSION,
            "step": step,
            "rank": self.groups.rank,
            "roles": roles,
            "loader": dict(self.c.loader.state_dict()),
            "rng": rng_state(self.groups.device),
            "extra": {name: cpu_copy(obj.state_dict()) for name, obj in self.stateful.items()},
        }

    def save(self, step: int) -> str:
        """Save the run's state at `step` (collective over all ranks)."""
        path = save_checkpoint(
            self.root, step, lambda: self._state(step), self._meta, self.groups, self.t.max_checkpoints
        )
        self.saved_step = step
        return path

    def after_step(self, step: int) -> dict[str, float]:
        """Save when `step` is a multiple of trainer.save_freq; returns `timing/save_checkpoint` if it did.

        The trainer calls it after writing the step's metrics line (so a kill during the save keeps that line)
        and logs the returned seconds on the next step's line; the last step's save prints its seconds."""
        if not self.t.save_freq or step % self.t.save_freq:
            return {}
        start = time.perf_counter()
        self.save(step)
        seconds = time.perf_counter() - start
        if step == self.t.total_steps:  # no further line to carry it
            self._say(f"saved step {step} in {seconds:.1f} s")
        return {"timing/save_checkpoint": seconds}

    def finish(self, step: int) -> None:
        """After the last step: save it (when trainer.save_freq > 0 and not saved yet)."""
        if self.t.save_freq and self.saved_step != step:
            self._say(f"saved {self.save(step)}")
