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
runs out of disk space says so, naming the device, the file and the size needed. Under split placement the
rollout ranks keep nothing; critic ranks (`placement.critic_ranks`) write their rank files into the same
checkpoint and take part in the agreement (engine/checkpoint/critic_ranks.py), so one checkpoint holds actor
and critic and is published only once both sides have written.

`trainer.resume=auto` takes the checkpoint `latest` names if it is usable (meta.json readable, every rank's
file a complete archive), else the next older usable one, saying which it skipped and why; if checkpoints
exist but none is usable it stops, naming each (engine/checkpoint/run_dir.py starts fresh instead with
trainer.overwrite=true). A truncated file met while loading is named with its checkpoint and the previous
complete checkpoint to resume from. `trainer.resume=PATH` naming a checkpoint of this output_dir older than
its latest is refused unless trainer.overwrite=true, which deletes the newer ones and points `latest` at PATH
before the first step (`branch_here`): otherwise a later resume=auto would take the other history's.

What one rank's state holds, and how it goes back into the live objects, is engine/checkpoint/checkpoint_state.py;
finding and reading checkpoints engine/checkpoint/store.py; writing files safely engine/checkpoint/files.py.

What this module must not do: reshard. A checkpoint resumes only under the layout it was saved with (tp, pp,
vpp, first/last stage layers where set, dp, world size, distributed optimizer); anything else is refused with
a message pointing at the way to change layout: export to Hugging Face (`python -m engine.export`) and start a
new run from it (`model.path`). The automatic stage split (parallel/stage_layers.py) is part of the format: a
checkpoint of an uneven split resumes only under the same rule.
Multi-node runs need `trainer.output_dir` on a filesystem every rank sees (rank 0 renames what all wrote).
The reference policy is not saved: it is rebuilt from `model.path` (or the seeded init) exactly as at start.
A resumed run follows its own config, not the saved one (LR schedule, Adam settings, trainer.total_steps: see
`load_role_state`); the resume message lists every config key whose value differs from the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from engine.checkpoint.checkpoint_state import (
    cpu_copy,
    load_role_state,
    rng_state,
    role_state_dict,
    set_rng_state,
)
from engine.checkpoint.files import (
    human_size,
    point_latest,
    publish,
    state_nbytes,
    write_file,
    write_rank_file,
)
from engine.checkpoint.store import (
    CHECKPOINTS_DIR,
    FORMAT_VERSION,
    LATEST_FILE,
    META_FILE,
    find_checkpoint,
    newer_checkpoints,
    prune_checkpoints,
    rank_file,
    read_meta,
    read_rank_state,
    step_dir_name,
)
from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.models.builder import ModelShape, moe_config
from engine.roles.offload import all_onloaded
from engine.roles.policy import MegatronRole
from engine.validate.placement import critic_dims
from parallel.dims import ParallelDims
from parallel.state import ProcessGroups

if TYPE_CHECKING:  # engine.setup builds everything; importing it here at run time is not needed
    from engine.setup import Components


def run_layout(groups: ProcessGroups, distributed_optimizer: bool) -> dict[str, Any]:
    """What must be equal for a per-rank checkpoint to resume: the shard layout of parameters and optimizer."""
    return dims_layout(groups.dims, distributed_optimizer)


def dims_layout(d: ParallelDims, distributed_optimizer: bool) -> dict[str, Any]:
    """`run_layout` of the layout `d`."""
    return {
        "world_size": d.world_size,
        "tp": d.tp,
        "pp": d.pp,
        "vpp": d.vpp,
        "dp": d.dp,
        "distributed_optimizer": bool(distributed_optimizer),
        # only when set, so that checkpoints of the automatic split keep the layout they were saved with
        **{k: getattr(d, k) for k in ("first_stage_layers", "last_stage_layers") if getattr(d, k)},
        **({"ep": d.ep} if d.ep > 1 else {}),
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
    arch = {k: v for k, v in shape_fields(shape).items() if k in fields and k != "moe"}
    return dataclasses.replace(model, **arch, moe=moe_config(shape.moe))


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


# MoEShape fields a resumed run may change: the router losses' coefficients and how tokens reach the experts
# of other ranks. The weights, their shapes and their layout do not depend on them (the resume message lists
# the changed model.moe.* keys as it lists every changed key).
_MOE_TRAINING_FIELDS = ("aux_loss_coef", "z_loss_coef", "token_dispatcher")


def _architecture(fields: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(fields)
    if isinstance(out.get("moe"), dict):
        out["moe"] = {k: v for k, v in out["moe"].items() if k not in _MOE_TRAINING_FIELDS}
    return out


def check_shape(saved: Mapping[str, Any], shape: ModelShape, path: str) -> None:
    """The checkpoint's model (`saved`: its `shape_fields`) is the one this run builds, up to the MoE
    training settings (`_MOE_TRAINING_FIELDS`)."""
    saved, now = _architecture(saved), _architecture(shape_fields(shape))
    differ = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if differ:
        raise CheckpointError(
            f"cannot resume from {path}: the model differs from the checkpoint's ((saved, now): {differ}). "
            f"Fix: resume with the same model.* settings (and model.path) as the run that saved it"
        )


# ---- atomic save ---------------------------------------------------------------------------------------


def savers_group(groups: ProcessGroups) -> dist.ProcessGroup:
    """The ranks that write one checkpoint together: the training ranks (`groups.world`), and under split
    placement with critic ranks the critic's too (`groups.savers`: global ranks 0 .. actor + critic ranks - 1)."""
    return groups.savers if groups.savers is not None else groups.world


def _failed_ranks(ok: bool, groups: ProcessGroups) -> list[int]:
    """Every saving rank learns which ranks failed (a collective: all of `savers_group` call it)."""
    group = savers_group(groups)
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=groups.device)
    flags[dist.get_rank(group)] = 0 if ok else 1
    dist.all_reduce(flags, group=group)
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
    when given as callables); `latest` then still names the previous checkpoint. "All ranks" are
    `savers_group(groups)`: with critic ranks the actor's and the critic's, each writing its own rank file.
    """
    name = step_dir_name(step)
    savers = savers_group(groups)
    box = [f"{name}.tmp-{secrets.token_hex(6)}" if groups.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=savers, device=groups.device)
    tmp = os.path.join(root, box[0])
    error: BaseException | None = None
    nbytes = 0
    try:
        os.makedirs(tmp, exist_ok=True)
        rank_state = state() if callable(state) else state
        nbytes = state_nbytes(rank_state)
        write_rank_file(rank_file(tmp, groups.rank), rank_state)
        if groups.rank == 0:
            meta = meta() if callable(meta) else meta
            text = json.dumps({**meta, "step": step, "format": FORMAT_VERSION}, indent=2)
            write_file(os.path.join(tmp, META_FILE), lambda f: f.write(text), len(text), binary=False)
    except Exception as err:  # every rank must reach the agreement below, whatever failed
        error = err
    failed = _failed_ranks(error is None, groups)
    final = os.path.join(root, name)
    if not failed:  # all wrote: rank 0 publishes, and everyone learns whether that worked
        if groups.rank == 0:
            try:
                publish(root, tmp, final)
            except Exception as err:
                error = err
        failed = _failed_ranks(error is None, groups)
    if failed:
        if groups.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        sizes = torch.tensor([float(nbytes)], dtype=torch.float64, device=groups.device)
        dist.all_reduce(sizes, group=savers)  # every rank is here: all saw the same `failed`
        raise CheckpointError(
            f"saving checkpoint {final} failed on rank(s) {failed}"
            + (f" (here: {type(error).__name__}: {error})" if error else "")
            + f"; {os.path.join(root, LATEST_FILE)} still names the previous checkpoint. The checkpoint "
            f"needs about {human_size(sizes.item())} (all ranks' files)"
        ) from error
    if groups.rank == 0:
        prune_checkpoints(root, max_checkpoints, keep=name)
    dist.barrier(group=savers)
    return final


def branch_here(path: str, output_dir: str, overwrite: bool, say: Callable[[str], None]) -> None:
    """Resuming from `path`, a checkpoint of output_dir older than its latest, branches off that run's
    history: refused (naming the newer checkpoints and the fixes) unless `overwrite`, which deletes the
    checkpoints after `path` and points `latest` at it, so that a later resume=auto follows the branch.
    Nothing to do for any other checkpoint (the latest, or one in another directory)."""
    newer = newer_checkpoints(path, output_dir)
    if not newer:
        return
    steps = ", ".join(str(s) for s, _ in newer)
    if not overwrite:
        raise CheckpointError(
            f"trainer.resume={path} is an older checkpoint of this run's trainer.output_dir={output_dir}, "
            f"which has newer ones (step(s) {steps}: {', '.join(p for _, p in newer)}). A branch from it here "
            f"would leave them behind, and a later trainer.resume=auto would take them, mixing the two runs. "
            f"Fix: to branch from it here, add trainer.overwrite=true (deletes the checkpoints of step(s) "
            f"{steps} and points {LATEST_FILE} at it); to keep both histories, start the branch in a new "
            f"trainer.output_dir with trainer.resume={path}; to continue the run, use trainer.resume=auto"
        )
    point_latest(os.path.dirname(os.path.normpath(path)), path)  # first: a crash below leaves a usable latest
    for _, other in newer:
        shutil.rmtree(other)
    say(f"trainer.overwrite=true: branching from {path}; deleted the checkpoints of step(s) {steps}")


def agreed_checkpoint(
    resume: str, output_dir: str, groups: ProcessGroups, say: Callable[[str], None], overwrite: bool
) -> str | None:
    """The checkpoint to resume from (None: start fresh), as rank 0 finds it (one view of the filesystem),
    on every rank of `savers_group`; a CheckpointError on all of them if there is none usable, or if it
    is an older checkpoint of output_dir and not `overwrite` (`branch_here`, done by rank 0)."""
    box: list[Any] = [None]
    if groups.rank == 0:
        skipped: list[str] = []
        try:
            found = find_checkpoint(resume, output_dir, skipped)
            if found is not None:
                branch_here(found, output_dir, overwrite, say)
            box[0] = ("ok", found)
        except CheckpointError as err:
            box[0] = ("error", str(err))
        for note in skipped:
            say(note)
    dist.broadcast_object_list(box, src=0, group=savers_group(groups), device=groups.device)
    kind, path = box[0]
    if kind == "error":
        raise CheckpointError(path)
    return path


def load_together(path: str, load: Callable[[str], int], groups: ProcessGroups) -> int:
    """Every rank of `savers_group` loads its own file (`load(path)`, returning the saved step); all fail
    together if any failed (a lone failing rank would leave the others in a collective)."""
    error: BaseException | None = None
    step = 0
    try:
        step = load(path)
    except Exception as err:
        error = err
    failed = _failed_ranks(error is None, groups)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"resuming from {path} failed on rank(s) {failed} (see their messages)")
    return step


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
        if c.split is not None and c.split.has_critic:  # its ranks save with these (critic_ranks.py)
            critic = critic_dims(c.cfg, self.groups.dims)
            self.layout["critic_ranks"] = dims_layout(critic, c.cfg.optim.distributed_optimizer)
        self.saved_step: int | None = None

    def _say(self, text: str) -> None:
        if self.groups.is_logging_rank:
            print(f"checkpoint: {text}", flush=True)

    def resume(self) -> int:
        """Load the checkpoint `trainer.resume` names (if any) into the live components; the step to
        continue from (0 = a fresh start)."""
        path = agreed_checkpoint(self.t.resume, self.c.output_dir, self.groups, self._say, self.t.overwrite)
        if path is None:
            if self.t.resume == "auto":
                self._say(f"trainer.resume=auto: no checkpoint in {self.root}; starting fresh")
            return 0
        step = load_together(path, self._load, self.groups)
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

    def _schedule_scale(self, saved: Mapping[str, Any] | None) -> tuple[int, int]:
        """(optimizer steps per RL step now, in the saved run), from the saved flat config (1, 1 without one)."""
        a = self.c.cfg.algorithm
        if not saved:
            return 1, 1
        before = saved.get("algorithm.ppo_epochs", a.ppo_epochs) * saved.get(
            "algorithm.num_mini_batches", a.num_mini_batches
        )
        return a.ppo_epochs * a.num_mini_batches, before

    def _load(self, path: str) -> int:
        meta = read_meta(path)
        check_layout(meta["layout"], self.layout, path)
        check_shape(meta["shape"], self.c.shape, path)
        state = read_rank_state(path, self.groups.rank)
        where = rank_file(path, self.groups.rank)
        scale = self._schedule_scale(meta.get("config"))
        for name, role in self.roles.items():
            if name not in state["roles"]:
                raise CheckpointError(f"{where} has no {name} state (it holds {sorted(state['roles'])})")
            with all_onloaded(role):
                load_role_state(role, state["roles"][name], where, scale)
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
            "roles": sorted([*self.roles, *(["critic"] if "critic_ranks" in self.layout else [])]),
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
