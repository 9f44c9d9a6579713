"""A training rank's side of split placement: each step, send the actor's weights to the rollout ranks and
receive this replica's scored responses (engine/step/collect.py calls `collect` in place of a rollout); a
reward model (reward.model_path, in the training layout here) adds its scores to what arrives, as colocated
scoring adds them to the rule's (engine/step/reward.py `score`); with critic ranks (`placement.critic_ranks`),
exchange experience, values, returns and metrics with the critic replica serving this replica
(engine/split/critic.py).

What must not happen here: generation or scoring (the rollout ranks do both, engine/split/worker.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.prompt_loader import PromptLoader
from engine.rewards.reward_fn import concat_extras
from engine.step.batch import Experience, Responses
from engine.step.validation import prompt_values
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

    def __init__(
        self,
        transfer: SplitTransfer,
        layout: SplitLayout,
        groups: ProcessGroups,
        everyone,
        off_policy_steps: int,
    ):
        self.transfer, self.layout, self.groups, self.everyone = transfer, layout, groups, everyone
        self.off_policy_steps = off_policy_steps
        """`trainer.off_policy_steps`: 1 when the rollout ranks generate step k + 1 while step k trains."""
        self.start_step = 0
        """The step this run started at (0, or the resumed checkpoint's)."""
        self.sent_for = -1
        """The step whose starting weights the rollout ranks already hold (sent for validation), else -1."""
        self.idle_engine = None
        """This rank's never-used rollout engine when the engine's start spans every rank (vLLM), held for the
        run (engine/split/run.py `_idle_rollout_engine`)."""

    @property
    def has_critic(self) -> bool:
        """Whether PPO's critic runs on ranks of its own (`placement.critic_ranks`)."""
        return self.layout.critic is not None

    def _is_replica_sender(self) -> bool:
        return self.layout.replica_ranks(self.groups.dp_rank)[0] == self.groups.rank

    def _to_critic(self, obj) -> None:
        """From the replica's first rank to every rank of the critic replica serving it."""
        if self._is_replica_sender():
            for dst in self.layout.critic_replica_ranks(self.groups.dp_rank):
                send_object(obj, dst, self.everyone)

    def _from_critic(self):
        return recv_object(self.layout.critic_replica_ranks(self.groups.dp_rank)[0], self.everyone)

    def send_experience(self, step: int, exp: Experience) -> None:
        """Critic ranks: the step's experience (its layout only) to the critic replica, which starts its value
        forward while this replica runs its own forwards."""
        self._to_critic((step, experience_for_critic(exp)))

    def receive_values(self) -> torch.Tensor:
        """Critic ranks: the (rows, T) values of this replica's experience."""
        return self._from_critic()

    def send_returns(self, exp: Experience) -> None:
        """Critic ranks: the (rows, T) returns of GAE, the critic's targets."""
        self._to_critic(exp.tensors["returns"])

    def receive_critic_metrics(self) -> dict[str, float]:
        """Critic ranks: the critic's metrics of the step (critic/*, timing/values, timing/critic_update)."""
        return self._from_critic()

    def start(self, step: int, loader: PromptLoader) -> None:
        """Tell the rollout ranks serving this replica where the run starts: the step (fresh: 0, resumed: the
        checkpoint's) and this replica's prompt-loader position; the critic ranks get the step. Sent by the
        replica's first rank.

        A checkpoint holds no batch in flight: resumed one step off policy, the rollout ranks regenerate the
        batch of the step after the checkpoint's with the checkpoint's weights (on policy, staleness 0), from
        the saved prompt position with that step's seeds (engine/split/worker.py `run`); the log says so."""
        self.start_step = step
        if step and self.off_policy_steps and self.groups.is_logging_rank:
            print(
                f"split placement: resumed at step {step} one step off policy (trainer.off_policy_steps="
                f"{self.off_policy_steps}): the batch of step {step + 1} that was in flight is not in the "
                f"checkpoint; the rollout ranks regenerate it with the checkpoint's weights (on policy, "
                f"rollout/staleness 0) from the saved prompt position with the step's seeds, so step {step + 1} "
                f"differs from an uninterrupted run's; the steps after it are one step off policy again",
                flush=True,
            )
        d, layout = self.groups.dp_rank, self.layout
        if layout.replica_ranks(d)[0] != self.groups.rank:
            return
        if self.has_critic:
            self._to_critic(step)
        for first in layout.serving_ranks(d):
            for j in range(layout.rollout_tp):
                send_object((step, loader.state_dict()), first + j, self.everyone)

    def collect(self, ctx: StepContext, round_index: int = 0) -> tuple[Responses, dict[str, float]]:
        """Send the current weights, then wait for this replica's responses (`timing/weight_transfer`,
        `timing/wait_rollout`), and score them with the reward model if there is one (`timing/reward_model`;
        `timing/reward` is the rollout side's); the loader takes the rollout side's position after this batch.
        Returns the responses and the rollout side's metrics of the step (`timing/gen`, `timing/reward`,
        `timing/wait_train`, `rollout_engine/*`; summed over the step's rounds so far). Multi-turn episodes'
        counts, sent with the responses, go to `ctx` (`StepContext.add_episode_totals`) as colocated rollout
        adds them.

        One step off policy (trainer.off_policy_steps=1) the responses arriving were generated with the
        previous step's weights (engine/split/worker.py `run`), and the last step sends none. No weights go
        out when validation after the previous step already sent them (timed in that step's `timing/testing`; no
        `timing/weight_transfer` then), nor for dynamic sampling's further
        rounds (`round_index` > 0: the rollout ranks generate them with the weights they hold)."""
        t = ctx.c.cfg.trainer
        on_policy = not t.off_policy_steps or ctx.step == self.start_step or ctx.step < t.total_steps - 1
        if round_index == 0 and on_policy and self.sent_for != ctx.step:
            with ctx.timer.phase("weight_transfer"):
                self.transfer.send()
        with ctx.timer.phase("wait_rollout"):
            parts = [
                recv_object(src, self.everyone) for src in self.layout.serving_ranks(self.groups.dp_rank)
            ]
        ctx.c.loader.load_state_dict(parts[0][1])
        responses = parts[0][0] if len(parts) == 1 else Responses.concat([p[0] for p in parts])
        for part in parts:  # multi-turn: the rollout side's counts of the episodes (`multi_turn/*`)
            if part[3] is not None:
                ctx.add_episode_totals(part[3])
        reward_model = ctx.c.reward_model
        # per round, before dynamic sampling's selection (engine/step/collect.py)
        if reward_model is not None:
            with ctx.timer.phase("reward_model"):
                prompts = [r.prompt_ids for r in responses.records]
                scores = reward_model(
                    prompts, responses.response_ids, responses.response_mask, responses.n, ctx.batcher
                )
            responses.scores = responses.scores + scores
        return responses, parts[0][2]

    def next_round(self, more: bool) -> None:
        """Dynamic sampling: tell the rollout ranks serving this replica whether the step needs another
        rollout round (the same answer on every replica). Sent by the replica's first rank."""
        d, layout = self.groups.dp_rank, self.layout
        if layout.replica_ranks(d)[0] != self.groups.rank:
            return
        for first in layout.serving_ranks(d):
            for j in range(layout.rollout_tp):
                send_object(more, first + j, self.everyone)

    def validate(self, ctx: StepContext) -> list[tuple[list[str], dict[str, torch.Tensor]]]:
        """Validation after `ctx.step` steps: send the weights (which the next step then does not send),
        receive each validation batch's shares from the rollout ranks serving this replica (worker.py
        `_validate`), concatenate them in order, add the reward model's scores (if any) and return each batch's
        (data sources, {name: value per prompt}) (engine/step/validation.py `prompt_values`)."""
        with ctx.timer.phase("weight_transfer"):
            self.transfer.send()
        self.sent_for = ctx.step
        with ctx.timer.phase("wait_rollout"):
            parts = [
                recv_object(src, self.everyone) for src in self.layout.serving_ranks(self.groups.dp_rank)
            ]
        c, per_prompt = ctx.c, []
        for b, shares in enumerate(zip(*parts)):  # one validation batch: each serving replica's share
            sources = [source for share in shares for source in share[0]]
            rollouts = range(len(shares[0][1]))
            scores = [torch.cat([share[1][i] for share in shares]) for i in rollouts]
            extras = [
                concat_extras([share[2][i] for share in shares], [len(share[1][i]) for share in shares])
                for i in rollouts
            ]
            answers = None if shares[0][3] is None else [a for share in shares for a in share[3]]
            if c.reward_model is not None:
                prompts = [r.prompt_ids for r in c.val_batches[b]]
                for i, n in enumerate((1, c.cfg.rollout.val_n)[: len(scores)]):
                    ids = torch.cat([share[4][i][0] for share in shares])
                    mask = torch.cat([share[4][i][1] for share in shares])
                    scores[i] = scores[i] + c.reward_model(prompts, ids, mask, n, ctx.batcher)
            per_prompt.append((sources, prompt_values(c.cfg.rollout.val_n, scores, extras, answers)))
        return per_prompt


def experience_for_critic(exp: Experience) -> Experience:
    """What the critic reads of the actor's experience: the layout, none of the phases' tensors."""
    return Experience(exp.tokens, exp.prompt_lens, exp.response_ids, exp.response_mask, exp.group_index)
