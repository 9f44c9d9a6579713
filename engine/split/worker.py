"""A rollout rank of split placement: tokenizer, prompt data, rollout engine, reward function and the
receiving end of the weight transfer; no model role, optimizer or training group.

Rollout replica e generates its prompt shares (`SplitLayout.assignments`: whole batches of the training
replicas d with d mod rollout DP == e, or with more rollout than training replicas share k of replica
e mod d_train's batch) exactly as colocated placement generates share k of replica d in a micro-DP group of
that many shares: a `PromptLoader` with dp_rank=d, the same share of its batch, the seed
`rollout_seed(seed, step, 0, d, k)`, the same scoring (`responses_of`) but for a reward model
(reward.model_path), which lives on the training ranks in the training layout (these ranks hold no megatron
state; their memory is the rollout engine's): they add its scores to the shares they receive. Its rollout TP
rank 0 sends each share's `Responses` (with the loader's position after the batch and the step's rollout-side metrics) to
replica d's tp x pp ranks, which concatenate the shares in order.

With rollout.multi_turn.enable the rollout ranks run the episode loop (engine/multi_turn/) with their engine and
the tools, as colocated rollout does, in training and validation: the responses they send hold the episode's
ids (tool tokens inside, mask 0 on them) and log-probs, scored on whole episodes, with the episodes' counts
for the trainers' `multi_turn/*` (`episode_totals`).

The rollout engine is `rollout.backend`'s (native or vLLM), fed with the shard `SplitTransfer.receive` returns:
the rollout TP group's ranks are consecutive, as vLLM's TP groups are (engine/validate/placement.py).

Checkpoints: a rollout rank writes none. Its state is the training side's: the weights arrive every step,
seeds follow from the step, and at start each training replica's first rank sends the step and its loader
position (`TrainerLink.start`), so a resumed run regenerates the batch that was in flight at the kill: one
step off policy with the checkpoint's weights, as the first step of any run is generated (staleness 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from algorithms.advantages import advantage_traits
from engine.config import TrainConfig
from engine.data import load_tokenizer, refuse_row_caps
from engine.metrics import PhaseTimer
from engine.multi_turn.episode import EpisodeRunner
from engine.prompt_loader import PromptLoader
from engine.rewards.build import build_reward_fn
from engine.rewards.reward_fn import RewardFn
from engine.rollout import build_rollout_engine
from engine.rollout.base import RolloutEngine
from engine.setup import (
    _data_files,
    build_episode_tools,
    build_episodes,
    load_prompts,
    model_shape,
    replica_val_batches,
)
from engine.split.link import recv_object, send_object
from engine.step.context import episode_totals, merge_engine_stats
from engine.step.reward import responses_of
from engine.step.rollout import (
    checkpoint_stop_ids,
    rollout_params,
    rollout_replica,
    rollout_seed,
    share_bounds,
)
from engine.step.validation import row_scores, validation_due
from engine.step_profiler import StepProfiler, rollout_side_busy
from parallel.rollout_weights import RolloutWeights
from parallel.split_plan import SplitLayout
from parallel.split_transfer import SplitTransfer


@dataclass
class RolloutWorker:
    """The rollout rank's loop (`run`); built by `build_rollout_worker`."""

    cfg: TrainConfig
    tokenizer: object
    reward_fn: RewardFn | None
    """The rule or reward.fn; None when the reward model's score is the reward alone (reward.combine=model)."""
    engine: RolloutEngine
    layout: SplitLayout
    rank: int
    everyone: dist.ProcessGroup
    device: torch.device
    loaders: dict[int, PromptLoader]
    """One prompt loader per training replica this rank serves, by training dp_rank."""
    shares: dict[int, tuple[int, int]]
    """(share, shares) of each served training replica's prompts that this rank generates."""
    tie_embeddings: bool
    """Whether the model ties its output layer to the embedding (the weight transfer sends one copy)."""
    transfer: SplitTransfer | None = None
    """The receiving end of the weight transfer (set once every rank has built its side)."""
    reward_model: None = None
    """Never set: a reward model (reward.model_path) runs on the training ranks, which add its scores to the
    ones sent from here (`TrainerLink.collect`, `TrainerLink.validate`); `responses_of` reads it."""
    weights: RolloutWeights | None = None
    """The actor's weights the engine generates with (the latest received)."""
    val_batches: dict[int, list] | None = None
    """The validation batches of each served training replica (as `Components.val_batches` there)."""
    output_dir: str = ""
    """The run's output directory: trainer.profile_steps' traces go to its profile/ (step_profiler.py)."""
    weights_step: int = 0
    """The step at whose start the trainers held `weights`."""
    wait_train: float = 0.0
    """Seconds spent receiving weights (waiting for the trainers included) since the last send."""
    episodes: EpisodeRunner | None = None
    """Multi-turn episodes with tools (rollout.multi_turn.enable), run here as colocated rollout runs them
    (engine/step/rollout.py); None: single-turn rollouts."""

    def _start_step(self) -> int:
        """The step to start at and each served replica's loader position, from its first training rank."""
        steps = set()
        for d, loader in self.loaders.items():
            step, state = recv_object(self.layout.replica_ranks(d)[0], self.everyone)
            loader.load_state_dict(state)
            steps.add(step)
        if len(steps) != 1:
            raise RuntimeError(f"the training replicas start at different steps {sorted(steps)}")
        return steps.pop()

    def run(self) -> None:
        """Serve every step from the start step to trainer.total_steps.

        On-policy (trainer.off_policy_steps=0): per step receive the weights, generate, send. One step off
        policy: the batch of step k is generated with the weights of step k - 1 while the trainers update on
        step k - 1's batch, then the weights of step k arrive and the batch goes out (the first step after the
        start is on-policy; the last step's weights are not sent, nothing would use them, unless validation
        after step k - 1 needs them). Validation after k steps runs on the weights of step k as soon as they
        arrive (`_receive`); dynamic sampling's further rounds follow the first (`_more_rounds`).

        A step of trainer.profile_steps runs its first round (and the weights' arrival) under the profiler: a
        trace per rank as the training ranks write theirs, and on CUDA the rollout phases' busy shares
        (`perf/gpu_busy/gen`, `perf/gpu_busy/reward`) sent with the step's other metrics."""
        start, total = self._start_step(), self.cfg.trainer.total_steps
        ahead = self.cfg.trainer.off_policy_steps
        profiler = StepProfiler(self.cfg.trainer.profile_steps, self.output_dir, self.rank, self.device)
        for step in range(start, total):
            timer, engine_stats = PhaseTimer(self.device), {}
            with profiler.step(step + 1) as busy:
                if not ahead or step == start:
                    self._receive(step, start)
                    ready = self._generate(step, 0, timer, engine_stats)
                else:
                    ready = self._generate(step, 0, timer, engine_stats)
                    if step < total - 1 or self._validates_at(step):
                        self._receive(step, start)
            engine_stats.update(rollout_side_busy(busy))
            self._send(ready, timer, engine_stats)
            self._more_rounds(step, timer, engine_stats)
        if start < total and self._validates_at(total):
            self._receive(total, start)

    def _validates_at(self, step: int) -> bool:
        """Whether the trainers validate after `step` steps (as engine/trainer.py decides)."""
        return bool(self.val_batches) and validation_due(self.cfg.trainer, step)

    def _receive(self, step: int, start: int) -> None:
        """The weights the trainers hold at the start of `step`, into the rollout engine; then validation
        after `step` steps if the trainers run one (not at the start step: validated before its checkpoint)."""
        begin = time.perf_counter()
        self.weights = self.transfer.receive()
        self.wait_train += time.perf_counter() - begin
        self.engine.set_weights(self.weights)
        self.weights_step = step
        if step != start and self._validates_at(step):
            self._validate(step)

    def _more_rounds(self, step: int, timer: PhaseTimer, engine_stats: dict[str, float]) -> None:
        """Dynamic sampling: generate and send further rounds of `step` while the trainers ask for one (each
        served replica's first rank says so; they agree)."""
        if not self.cfg.algorithm.dynamic_sampling:
            return
        round_index = 1
        while all([recv_object(self.layout.replica_ranks(d)[0], self.everyone) for d in self.loaders]):
            self._send(self._generate(step, round_index, timer, engine_stats), timer, engine_stats)
            round_index += 1

    def _generate(
        self, step: int, round_index: int, timer: PhaseTimer, engine_stats: dict[str, float]
    ) -> dict[int, tuple]:
        """Generate and score each served share of one rollout round of `step`'s batch with the weights held
        now: {training replica: (Responses, its loader's position after the batch)}; the rollout side's
        seconds and engine statistics add to `timer` and `engine_stats`. With multi-turn episodes each
        message also holds the "sample" rollout's `episode_totals` (the trainers' `multi_turn/*`), else None."""
        cfg, eos = self.cfg, checkpoint_stop_ids(self.cfg, self.tokenizer)
        greedy = advantage_traits(cfg.algorithm.adv_estimator).needs_greedy_baseline
        messages = {}
        for d, loader in self.loaders.items():
            share, shares = self.shares[d]
            batch = loader.next_batch()
            first, end = share_bounds(len(batch), shares, share)
            records = batch[first:end]
            prompts = [r.prompt_ids for r in records]
            seed = rollout_seed(cfg.trainer.seed, step, round_index, d, share)
            params = rollout_params(cfg, eos, seed, records)
            tool_names = [r.tools for r in records] if self.episodes is not None else None
            outs, totals = [], None
            for kind in ("sample", "greedy") if greedy else ("sample",):
                with timer.phase("gen"):
                    outs.append(
                        rollout_replica(
                            self.engine, self.weights, prompts, params[kind], self.episodes, tool_names
                        )
                    )
                merge_engine_stats(engine_stats, self.engine.last_stats)
                if self.episodes is not None and kind == "sample":
                    totals = episode_totals(outs[-1].episodes, self.episodes.last_stats["tool_s"])
            with timer.phase("reward"):
                responses = responses_of(self, records, outs, None)
            if cfg.trainer.off_policy_steps:
                rows = responses.response_ids.shape[0]
                responses.staleness = torch.full((rows,), float(step - self.weights_step))
            messages[d] = (responses, loader.state_dict(), totals)
        return messages

    def _validate(self, step: int) -> None:
        """Generate and score each served share of every validation batch with the weights held now (those
        of step `step`, after `step` steps), with the seeds and scoring of colocated validation; rollout TP
        rank 0 sends each training replica's [(data sources, row scores per rollout, reward extras per rollout,
        maj@k answers or None, (response ids, response mask) per rollout when a reward model scores on the
        trainers, else None) per batch]."""
        cfg, eos = self.cfg, checkpoint_stop_ids(self.cfg, self.tokenizer)
        kinds = ("val", "val_sample") if cfg.rollout.val_n > 1 else ("val",)
        for d, batches in self.val_batches.items():
            share, shares = self.shares[d]
            seed = rollout_seed(cfg.trainer.seed, step, 0, d, share)
            per_batch = []
            for batch in batches:
                first, end = share_bounds(len(batch), shares, share)
                records = batch[first:end]
                params = rollout_params(cfg, eos, seed, records)
                prompts = [r.prompt_ids for r in records]
                tool_names = [r.tools for r in records] if self.episodes is not None else None
                outs = [
                    rollout_replica(self.engine, self.weights, prompts, params[k], self.episodes, tool_names)
                    for k in kinds
                ]
                scores, extras, answers = row_scores(self, records, outs, None)
                rows = [(o.response_ids, o.response_mask) for o in outs] if cfg.reward.model_path else None
                per_batch.append(([r.data_source for r in records], scores, extras, answers, rows))
            if self.layout.rollout_coords(self.rank)[0] == 0:
                for dst in self.layout.replica_ranks(d):
                    send_object(per_batch, dst, self.everyone)

    def _send(self, messages: dict, timer: PhaseTimer, engine_stats: dict[str, float]) -> None:
        """Rollout TP rank 0: each share to its training replica's ranks, with the rollout side's metrics."""
        side = {**timer.as_metrics(), **engine_stats, "timing/wait_train": self.wait_train}
        self.wait_train = 0.0
        if self.layout.rollout_coords(self.rank)[0] != 0:
            return
        for d, (responses, state, totals) in messages.items():
            for dst in self.layout.replica_ranks(d):
                send_object((responses, state, side, totals), dst, self.everyone)


def build_rollout_worker(
    cfg: TrainConfig, layout: SplitLayout, rank: int, everyone, device: torch.device, output_dir: str
) -> RolloutWorker:
    """Everything a rollout rank needs except the weight transfer (constructed after, on every rank)."""
    tok_dir, train_files, val_files = _data_files(cfg, output_dir)
    tokenizer = load_tokenizer(
        tok_dir, key="model.path" if tok_dir == cfg.model.path else "model.tokenizer_path"
    )
    tools = build_episode_tools(cfg)  # as the training ranks render the prompts (engine/setup.py)
    schemas = {name: tool.schema for name, tool in tools.items()} if tools else None
    train = layout.train
    # the training side's logging rank loads the same files and reports what is not used (log=False here)
    records = load_prompts(cfg, train_files, tokenizer, schemas, "data.train_files", False)
    val_records = []
    if val_files and cfg.trainer.test_freq:
        val_records = load_prompts(cfg, val_files, tokenizer, schemas, "data.val_files", False)
    if tools is not None:
        refuse_row_caps(records, "data.train_files")
        refuse_row_caps(val_records, "data.val_files")
    shape = model_shape(cfg.model, len(tokenizer), train.tp)
    engine = build_rollout_engine(
        cfg.rollout, shape, device, tokenizer.pad_token_id, model_dir=cfg.model.path, seed=cfg.trainer.seed
    )
    reward_fn = None  # the reward model alone (reward.combine=model): the trainers score
    if not cfg.reward.model_path or cfg.reward.combine == "sum":
        reward_fn = build_reward_fn(
            cfg.reward.fn, gsm8k_method=cfg.reward.gsm8k_method, timeout_s=cfg.reward.timeout_s
        )
        reward_fn.check_data_sources([r.data_source for r in records])
    _, e = layout.rollout_coords(rank)
    shares = {d: (share, num) for d, share, num in layout.assignments(e)}
    loaders = {
        d: PromptLoader(
            records,
            cfg.data.batch_size,
            cfg.trainer.seed,
            d,
            train.dp,
            cfg.data.shuffle,
            num_mini_batches=cfg.algorithm.num_mini_batches,
        )
        for d in shares
    }
    per_rank = cfg.data.batch_size // train.dp
    val_batches = {d: replica_val_batches(val_records, train.dp, d, per_rank) for d in shares}
    return RolloutWorker(
        cfg,
        tokenizer,
        reward_fn,
        engine,
        layout,
        rank,
        everyone,
        device,
        loaders,
        shares,
        shape.tie_embeddings,
        val_batches=val_batches if any(val_batches.values()) else {},
        output_dir=output_dir,
        episodes=build_episodes(cfg, tools, tokenizer, shape, records + val_records),
    )
