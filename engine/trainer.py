"""The RL loop: for each step, rollout -> reward -> (old/ref log-probs, values) -> advantages -> critic and
actor updates -> metrics.

Phases and their `timing/<phase>` names follow DESIGN.md's data flow. Model roles, the weight transition, the
rollout engine, data and rewards are built by engine/setup.py; each phase lives in engine/step/ (rollout,
reward, dynamic sampling, advantages, update, statistics); this module sequences them and gathers the step's
metrics. It makes no collective call of its own.

The old-log-prob forward runs when the actor takes more than one optimizer step per batch
(engine/config_rules.py `needs_old_log_prob_forward`): with a single step the old log-probs equal the current
ones, so the ratio is 1 by construction (actor/ppo_kl = 0, actor/pg_clipfrac = 0) and actor/rollout_kl
reports the rollout-vs-training gap instead. A KL in the reward also needs it when the rollout's log-probs
are not the policy's: none returned (below), or generated with older weights (trainer.off_policy_steps).

With rollout.log_probs=false the rollout returns no log-probs (engine/validate/ refuses it with TIS, which
needs the rollout's own): the experience has no `rollout_log_probs`, a KL in the reward takes the
old-log-prob forward's (it then runs even for a single step), and actor/rollout_kl and rollout/logprob_mean
are not logged (absent, not zero).
"""

from __future__ import annotations

import time

import torch

from algorithms.kl import make_kl_controller
from engine.checkpoint.checkpoint import Checkpointer
from engine.config_rules import max_response_tokens, needs_old_log_prob_forward
from engine.metrics import PhaseTimer
from engine.roles.dynamic_batch import trainer_batcher
from engine.roles.offload import RoleOffloader
from engine.setup import Components
from engine.step.advantages import advantages
from engine.step.batch import Experience, experience_from
from engine.step.collect import collect
from engine.step.context import StepContext
from engine.step.losses import log_prob_fn, value_fn
from engine.step.stats import multi_turn_metrics, perf_metrics, rollout_metrics
from engine.step.update import forward_rows, update_actor, update_critic
from engine.step.validation import validate, validation_due
from engine.step_profiler import StepProfiler
from engine.tools.export import export_after_fit


class Trainer:
    """Runs `trainer.total_steps` RL steps over `Components` built for this rank."""

    def __init__(self, c: Components):
        self.c = c
        self.cfg = c.cfg
        self.step = 0
        alg = self.cfg.algorithm
        self.needs_old_forward = needs_old_log_prob_forward(
            alg, self.cfg.rollout.log_probs, self.cfg.trainer.off_policy_steps
        )
        self.rollout_log_probs = self.cfg.rollout.log_probs
        """Whether sampled responses come with their rollout log-probs (the same on every rank)."""
        self.kl_ref = c.reference is not None
        self.kl_ctrl = make_kl_controller(
            alg.kl_ctrl, kl_coef=alg.kl_reward_coef, target=alg.kl_target, horizon=alg.kl_horizon
        )
        t = self.cfg.trainer  # offloaders are no-ops unless enabled (and for absent roles)
        self.ref_offload = RoleOffloader(c.reference, ("params",), enabled=t.offload_reference)
        self.actor_optim_offload = RoleOffloader(c.actor, ("optimizer",), enabled=t.offload_optimizer)
        self.critic_optim_offload = RoleOffloader(c.critic, ("optimizer",), enabled=t.offload_optimizer)
        graphs = c.actor.layer_graphs is not None
        self.batcher = trainer_batcher(
            t, c.groups.dims, c.groups.device, graphs, c.micro_batch_token_cap, c.share_prompts
        )
        self.last_experience: Experience | None = None
        """The latest step's experience on this rank (for inspection and tests)."""
        self.engine_stats: dict[str, float] = {}
        """This rank's rollout engine statistics of the latest step (`StepContext.add_engine_stats`)."""

    def _context(self) -> StepContext:
        return StepContext(self.c, self.batcher, self.step, PhaseTimer(self.c.groups.device))

    def train_step(self) -> dict[str, float]:
        c, g, T = self.c, self.c.groups, self.cfg.rollout.temperature
        ctx = self._context()
        timer = ctx.timer
        if g.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(g.device)
        start = time.perf_counter()
        responses, sampling_metrics = collect(ctx)
        exp = experience_from(
            responses, g.dp_rank, c.tokenizer.pad_token_id, g.dims.seq_multiple, self.rollout_log_probs
        )
        critic_ranks = c.split is not None and c.split.has_critic  # engine/split/critic.py
        if critic_ranks:
            c.split.send_experience(self.step, exp)
        if self.needs_old_forward:
            with timer.phase("old_log_prob"):
                exp.tensors["old_log_probs"] = forward_rows(
                    c.actor, exp, log_prob_fn, "log_probs", self.batcher, T
                )
        if self.kl_ref:
            with timer.phase("ref"), self.ref_offload.onloaded():
                exp.tensors["ref_log_probs"] = forward_rows(
                    c.reference, exp, log_prob_fn, "log_probs", self.batcher, T
                )
        if c.critic is not None:
            with timer.phase("values"):
                exp.tensors["values"] = forward_rows(c.critic, exp, value_fn, "values", self.batcher)
        elif critic_ranks:
            with timer.phase("wait_critic"):
                exp.tensors["values"] = c.split.receive_values()
        with timer.phase("adv"):
            adv_metrics = advantages(exp, self.cfg.algorithm, self.kl_ctrl, g)
        critic_metrics = {}
        if critic_ranks:
            c.split.send_returns(exp)
        self.batcher.reset_counts()  # the update's micro-batches, for perf/padding_fraction & co.
        if c.critic is not None:
            with timer.phase("update_critic"), self.critic_optim_offload.onloaded():
                critic_metrics = update_critic(ctx, exp)
        with timer.phase("update_actor"), self.actor_optim_offload.onloaded():
            actor_metrics = update_actor(
                ctx, exp, self.needs_old_forward, self.kl_ref, self.rollout_log_probs
            )
        if critic_ranks:
            with timer.phase("wait_critic"):
                critic_metrics = c.split.receive_critic_metrics()
        timer.seconds["step"] = time.perf_counter() - start
        self.step += 1
        self.last_experience = exp
        self.engine_stats = ctx.engine_stats
        metrics = {
            **rollout_metrics(exp, g, self.rollout_log_probs, max_response_tokens(c.cfg.rollout)),
            **sampling_metrics,
            **adv_metrics,
            **critic_metrics,
            **actor_metrics,
            **timer.as_metrics(),
            **ctx.engine_stats,
        }
        metrics.update(perf_metrics(c, exp, timer.seconds, timer.peak_gb, tuple(self.batcher.token_counts)))
        if c.episodes is not None:
            metrics.update(multi_turn_metrics(ctx.multi_turn, g))
        metrics["data/epoch"] = c.loader.epoch
        return metrics

    def validate(self) -> dict[str, float]:
        """Validation rewards (engine/step/validation.py)."""
        return validate(self._context())

    def fit(self) -> None:
        c, t = self.c, self.cfg.trainer
        try:
            checkpointer = Checkpointer(c, stateful={"kl_ctrl": self.kl_ctrl})
            self.step = checkpointer.resume()
            if c.split is not None:  # the rollout ranks start where the training side does
                c.split.start(self.step, c.loader)
            c.logger.resume_at(self.step)
            self.ref_offload.offload()
            if t.val_before_train and self.step == 0 and c.val_batches:  # the starting model, as step 0
                c.logger.log(0, self.validate())
            save_metrics: dict[str, float] = {}  # the save after a step, logged on the next step's line
            profiler = StepProfiler(t.profile_steps, c.output_dir, c.groups.rank, c.groups.device)
            while self.step < t.total_steps:
                with profiler.step(self.step + 1) as profiled:
                    metrics = self.train_step()
                metrics.update(profiled)
                if validation_due(t, self.step) and c.val_batches:
                    metrics.update(self.validate())
                metrics.update(save_metrics)
                c.logger.log(self.step, metrics)  # written before the save: a kill during it keeps the line
                save_metrics = checkpointer.after_step(self.step)
            checkpointer.finish(self.step)
            if t.export_hf:
                export_after_fit(c, self.step)
        finally:
            c.logger.close()
