"""A training rank's side of split placement: each step, send the actor's weights to the rollout ranks and
receive this replica's scored responses (engine/step/collect.py calls `collect` in place of a rollout).

What must not happen here: generation or scoring (the rollout ranks do both, engine/split/worker.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from engine.data import PromptLoader
from engine.step.batch import Responses
from parallel.split_plan import SplitLayout
from parallel.split_transfer import SplitTransfer
from parallel.state import ProcessGroups

if TYPE_CHECKING:
    from engine.step.context import StepContext


def send_object(obj, dst: int, group: dist.ProcessGroup) -> None:
    dist.send_object_list([obj], dst=dst, group=group)


def recv_object(src: int, group: dist.ProcessGroup):
    box = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


class TrainerLink:
    """The training side of the exchange with the rollout ranks; one per training rank."""

    def __init__(self, transfer: SplitTransfer, layout: SplitLayout, groups: ProcessGroups, everyone):
        self.transfer, self.layout, self.groups, self.everyone = transfer, layout, groups, everyone
        self.start_step = 0
        """The step this run started at (0, or the resumed checkpoint's)."""

    def start(self, step: int, loader: PromptLoader) -> None:
        """Tell the rollout ranks serving this replica where the run starts: the step (fresh: 0, resumed: the
        checkpoint's) and this replica's prompt-loader position. Sent by the replica's first rank."""
        self.start_step = step
        d, layout = self.groups.dp_rank, self.layout
        if layout.replica_ranks(d)[0] != self.groups.rank:
            return
        for first in layout.serving_ranks(d):
            for j in range(layout.rollout_tp):
                send_object((step, loader.state_dict()), first + j, self.everyone)

    def collect(self, ctx: StepContext) -> tuple[Responses, dict[str, float]]:
        """Send the current weights, then wait for this replica's responses (`timing/weight_transfer`,
        `timing/wait_rollout`); the loader takes the rollout side's position after this batch. Returns the
        responses and the rollout side's metrics of the step (`timing/gen`, `timing/reward`,
        `timing/wait_train`, `rollout_engine/*`).

        One step off policy (trainer.off_policy_steps=1) the responses arriving were generated with the
        previous step's weights (engine/split/worker.py `run`), and the last step sends none."""
        t = ctx.c.cfg.trainer
        if not t.off_policy_steps or ctx.step == self.start_step or ctx.step < t.total_steps - 1:
            with ctx.timer.phase("weight_transfer"):
                self.transfer.send()
        with ctx.timer.phase("wait_rollout"):
            parts = [
                recv_object(src, self.everyone) for src in self.layout.serving_ranks(self.groups.dp_rank)
            ]
        ctx.c.loader.load_state_dict(parts[0][1])
        responses = parts[0][0] if len(parts) == 1 else Responses.concat([p[0] for p in parts])
        return responses, parts[0][2]
