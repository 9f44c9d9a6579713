"""A critic rank of split placement (`placement.critic_ranks`): PPO's value model on ranks of its own, with its
own TP x PP (`placement.critic_tp`, `critic_pp`) and the actor's DP size; critic replica d serves training
replica d. No rollout, reward, reference or actor here.

Per step, with the actor's replica d (engine/split/link.py):
    actor -> critic   the step's experience without its tensors (tokens, prompt lengths, responses, mask)
    critic -> actor   values (rows, T), from the critic's value forward
    actor -> critic   returns (rows, T), after GAE
    critic -> actor   the critic's metrics (critic/*, timing/values, timing/critic_update)
The actor's replica computes GAE, not the critic: the token rewards need what only the actor side holds (the
KL in the reward from the reference and old log-probs, the KL controller's state) and the advantages are
whitened over the actor's DP replicas; values and returns, two (rows, T) float tensors, are all that
crosses besides the batch itself. The critic's value forward overlaps the actor's reference and old-log-prob
forwards, its update the actor's update. One rank of each side sends, each rank of the other side receives:
no rank gathers the batch.

With the critic's layout equal to the actor's, every metric equals the critic-on-the-actor's-ranks run's:
the same seeded initialisation, micro-batches and update seeds (`trainer.seed + step`).

Checkpoints: each critic rank saves and resumes its shards of the critic in the actor's checkpoints, in the
same collective save and resume (engine/checkpoint/critic_ranks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from engine.checkpoint.critic_ranks import CriticRanksCheckpointer
from engine.config import TrainConfig
from engine.data import load_tokenizer
from engine.metrics import PhaseTimer
from engine.roles.dynamic_batch import MicroBatcher, micro_batch_shapes_vary, trainer_batcher
from engine.roles.memory_cap import trainer_token_cap
from engine.roles.offload import RoleOffloader
from engine.roles.policy import MegatronRole
from engine.setup import _data_files, build_critic, model_shape
from engine.split.link import recv_object, send_object
from engine.step.context import StepContext
from engine.step.losses import value_fn
from engine.step.update import forward_rows, update_critic
from engine.validate.built import built_model
from engine.validate.run import prompts_shared
from parallel.split_plan import SplitLayout
from parallel.state import ProcessGroups


@dataclass
class CriticSide:
    """What `update_critic` reads of `Components` (`ctx.c`), on a critic rank."""

    cfg: TrainConfig
    groups: ProcessGroups
    critic: MegatronRole


@dataclass
class CriticWorker:
    """The critic rank's loop (`run`); built by `build_critic_worker`."""

    side: CriticSide
    layout: SplitLayout
    everyone: dist.ProcessGroup
    batcher: MicroBatcher
    offload: RoleOffloader
    checkpointer: CriticRanksCheckpointer

    @property
    def actor_first(self) -> int:
        """The first rank of the training replica this critic replica serves (it sends everything)."""
        return self.layout.replica_ranks(self.side.groups.dp_rank)[0]

    def _is_sender(self) -> bool:
        g = self.side.groups
        return self.layout.critic_replica_ranks(g.dp_rank)[0] == g.rank

    def _to_actor(self, obj) -> None:
        """From the critic replica's first rank to every rank of the actor's replica."""
        if self._is_sender():
            for dst in self.layout.replica_ranks(self.side.groups.dp_rank):
                send_object(obj, dst, self.everyone)

    def run(self) -> None:
        """Resume with the actor's ranks, then serve every step from the actor's start step to
        trainer.total_steps, saving when and as they do."""
        self.checkpointer.resume()
        start = recv_object(self.actor_first, self.everyone)
        total = self.side.cfg.trainer.total_steps
        for step in range(start, total):
            self.step()
            self.checkpointer.after_step(step + 1)
        self.checkpointer.finish(max(start, total))

    def step(self) -> None:
        """One step: values for the actor's experience, then the critic's update on the actor's returns."""
        g = self.side.groups
        step, exp = recv_object(self.actor_first, self.everyone)
        timer = PhaseTimer(g.device)
        with timer.phase("values"):
            exp.tensors["values"] = forward_rows(self.side.critic, exp, value_fn, "values", self.batcher)
        self._to_actor(exp.tensors["values"])
        exp.tensors["returns"] = recv_object(self.actor_first, self.everyone)
        ctx = StepContext(self.side, self.batcher, step, timer)
        with timer.phase("critic_update"), self.offload.onloaded():
            metrics = update_critic(ctx, exp)
        self._to_actor({**metrics, **timer.as_metrics()})


def build_critic_worker(
    cfg: TrainConfig, layout: SplitLayout, groups: ProcessGroups, everyone, output_dir: str
) -> CriticWorker:
    """The critic role on this critic rank (the seeded init or critic.path / model.path, as on the actor's
    ranks) and its loop."""
    tok_dir, _, _ = _data_files(cfg, output_dir)
    tokenizer = load_tokenizer(
        tok_dir, key="model.path" if tok_dir == cfg.model.path else "model.tokenizer_path"
    )
    shape = model_shape(cfg.model, len(tokenizer), groups.dims.tp)
    alg, t = cfg.algorithm, cfg.trainer
    steps = t.total_steps * alg.ppo_epochs * alg.num_mini_batches
    critic = build_critic(cfg, shape, len(tokenizer), groups, steps)
    if micro_batch_shapes_vary(t, groups.dims.vpp) and groups.dims.pp > 1:
        critic.config.variable_seq_lengths = True
    batcher = trainer_batcher(
        t,
        groups.dims,
        groups.device,
        token_cap=trainer_token_cap(cfg, shape, groups, [critic]),
        share_prompts=prompts_shared(cfg, built_model(cfg)),
    )
    offload = RoleOffloader(critic, ("optimizer",), enabled=t.offload_optimizer)
    checkpointer = CriticRanksCheckpointer(cfg, groups, critic, output_dir)
    return CriticWorker(CriticSide(cfg, groups, critic), layout, everyone, batcher, offload, checkpointer)
