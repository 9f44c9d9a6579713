"""Checkpoints on the critic's own ranks (split placement with `placement.critic_ranks`): each critic rank writes
`rank_<r>.pt` (r its global rank, after the actor's ranks) into the checkpoint directory the actor's ranks
write, in the same atomic save (engine/checkpoint/checkpoint.py `save_checkpoint` over `savers_group`: the
checkpoint is published once every actor and critic rank has written), and resumes from the checkpoint rank 0
picks, as the actor's ranks do.

A critic rank's file holds the critic role's shards (parameters, optimizer state, LR schedule), the step and
the RNG states; no data position (the actor's ranks keep it). meta.json is rank 0's (an actor rank): its
layout's `critic_ranks` entry is the critic's layout, checked here on resume.

The calls mirror `Checkpointer`'s on the actor's ranks one for one (`resume` before the step loop,
`after_step` after each step, `finish` after the last): each is a collective over both sides.
"""

from __future__ import annotations

import os
from typing import Any

from engine.checkpoint.checkpoint import (
    agreed_checkpoint,
    check_layout,
    load_together,
    run_layout,
    save_checkpoint,
)
from engine.checkpoint.checkpoint_state import load_role_state, rng_state, role_state_dict, set_rng_state
from engine.checkpoint.store import CHECKPOINTS_DIR, FORMAT_VERSION, rank_file, read_meta, read_rank_state
from engine.config import TrainConfig
from engine.errors import CheckpointError
from engine.roles.offload import all_onloaded
from engine.roles.policy import MegatronRole
from parallel.state import ProcessGroups


class CriticRanksCheckpointer:
    """Saves and resumes the critic role on a critic rank."""

    def __init__(self, cfg: TrainConfig, groups: ProcessGroups, critic: MegatronRole, output_dir: str):
        self.t = cfg.trainer
        self.groups, self.critic, self.output_dir = groups, critic, output_dir
        self.root = os.path.join(output_dir, CHECKPOINTS_DIR)
        self.layout = run_layout(groups, cfg.optim.distributed_optimizer)
        self.saved_step: int | None = None

    def resume(self) -> int:
        """Load the critic's shards of the checkpoint `trainer.resume` names (if any); the step to continue
        from (0 = a fresh start)."""
        path = agreed_checkpoint(
            self.t.resume, self.output_dir, self.groups, lambda _: None, self.t.overwrite
        )
        if path is None:
            return 0
        self.saved_step = load_together(path, self._load, self.groups)
        return self.saved_step

    def _load(self, path: str) -> int:
        saved = read_meta(path)["layout"].get("critic_ranks")
        if saved is None:
            raise CheckpointError(
                f"cannot resume from {path} with placement.critic_ranks: it holds no critic ranks' shards (saved "
                "with the critic on the actor's ranks, or without a critic). Fix: resume it with the "
                "placement it was saved with, or start a new run (trainer.resume=off, another output_dir)"
            )
        check_layout(saved, self.layout, path)
        state = read_rank_state(path, self.groups.rank)
        where = rank_file(path, self.groups.rank)
        if "critic" not in state["roles"]:
            raise CheckpointError(f"{where} has no critic state (it holds {sorted(state['roles'])})")
        with all_onloaded(self.critic):
            load_role_state(self.critic, state["roles"]["critic"], where)
        set_rng_state(state["rng"], self.groups.device)
        return state["step"]

    def _state(self, step: int) -> dict[str, Any]:
        with all_onloaded(self.critic):
            critic = role_state_dict(self.critic)
        return {
            "format": FORMAT_VERSION,
            "step": step,
            "rank": self.groups.rank,
            "roles": {"critic": critic},
            "rng": rng_state(self.groups.device),
        }

    def save(self, step: int) -> None:
        save_checkpoint(self.root, step, lambda: self._state(step), {}, self.groups, self.t.max_checkpoints)
        self.saved_step = step

    def after_step(self, step: int) -> None:
        """Save when `step` is a multiple of trainer.save_freq (as the actor's `Checkpointer.after_step`)."""
        if self.t.save_freq and not step % self.t.save_freq:
            self.save(step)

    def finish(self, step: int) -> None:
        """After the last step: save it when the actor's ranks do (`Checkpointer.finish`)."""
        if self.t.save_freq and self.saved_step != step:
            self.save(step)
