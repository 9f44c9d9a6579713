"""The RL loop: for each step, rollout -> reward -> (old/ref log-probs, values) -> advantages -> critic and
actor updates -> metrics.

Phases and their `timing/<phase>` names follow DESIGN.md's data flow. Model roles, the weight transition, the
rollout engine, data and rewards are built by engine/setup.py; the per-phase logic lives in
engine/advantage_phase.py, engine/update_phase.py, engine/dynamic_sampling.py and engine/dynamic_batch.py;
this module sequences them and gathers the step's metrics.

The old-log-prob forward runs only when the actor takes more than one optimizer step per batch
(engine/config.py `needs_old_log_prob_forward`): with a single on-policy step the old log-probs equal the
current ones, so the ratio is 1 by construction (actor/ppo_kl = 0, actor/pg_clipfrac = 0) and
actor/rollout_kl reports the rollout-vs-training gap instead.

With rollout.log_probs=false the rollout returns no log-probs (engine/validate.py refuses it with TIS, which
needs the rollout's own): the experience has no `rollout_log_probs`, a KL in the reward takes the
old-log-prob forward's (it then runs even for a single step), and actor/rollout_kl and rollout/logprob_mean
are not logged (absent, not zero).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.distributed as dist

from algorithms.advantages import advantage_traits
from algorithms.dapo import overlong_penalty
from algorithms.kl import make_kl_controller
from engine.advantage_phase import compute_advantages, dp_sum
from engine.batch import Experience, Responses, build_experience
from engine.checkpoint import Checkpointer
from engine.config import needs_old_log_prob_forward, overlong_buffer_tokens
from engine.dynamic_batch import MicroBatcher
from engine.dynamic_sampling import GroupSelector, global_order, replica_share
from engine.export import export_after_fit
from engine.metrics import PhaseTimer
from engine.offload import RoleOffloader
from engine.perf import mfu, train_flops
from engine.role_losses import (
    ACTOR_FIRST_MINI_BATCH_METRICS,
    CRITIC_METRICS,
    actor_metric_names,
    log_prob_fn,
    make_actor_loss,
    make_critic_loss,
    value_fn,
)
from engine.rollout.base import RolloutOutput, SamplingParams
from engine.rollout_phase import rollout_replica
from engine.setup import Components
from engine.update_phase import forward_rows, run_updates
from engine.validation import decode_responses, per_source_means, response_answers, sample_metrics

REWARD_EXTRA = "reward_extra/"  # exp.tensors key prefix of the reward function's numeric extras


class Trainer:
    """Runs `trainer.total_steps` RL steps over `Components` built for this rank."""

    def __init__(self, c: Components):
        self.c = c
        self.cfg = c.cfg
        self.step = 0
        alg, g = self.cfg.algorithm, c.groups
        self.needs_old_forward = needs_old_log_prob_forward(alg, self.cfg.rollout.log_probs)
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
        self.batcher = MicroBatcher(
            self.cfg.trainer.micro_batch_size,
            self.cfg.trainer.max_tokens_per_micro_batch,
            seq_multiple=g.dims.seq_multiple,
            device=g.device,
        )
        self.last_experience: Experience | None = None
        """The latest step's experience on this rank (for inspection and tests)."""
        self.engine_stats: dict[str, float] = {}
        """This rank's rollout engine statistics of the current step (`_add_engine_stats`)."""

    # ---- rollout and reward -----------------------------------------------------------------
    def _sampling(self, greedy: bool, seed: int, temperature: float | None = None) -> SamplingParams:
        r, tok = self.cfg.rollout, self.c.tokenizer
        if temperature is None:
            temperature = r.val_temperature if greedy else r.temperature
        return SamplingParams(
            n=1 if greedy else r.n,
            temperature=temperature,
            top_p=1.0 if greedy else r.top_p,
            top_k=0 if greedy else r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=(tok.eos_token_id,),
            ignore_eos=r.ignore_eos,
            seed=seed,
            log_probs=self.rollout_log_probs and not greedy,  # greedy/val responses are only scored
        )

    def _rollout_seed(self, round_index: int) -> int:
        g = self.c.groups
        weights = self.c.rollout_weights
        return (
            self.cfg.trainer.seed * 1_000_003
            + self.step * 7919
            + round_index * 15_485_863
            + g.dp_rank * 104_729
            + weights.micro_dp_rank
        ) % (2**62)

    def _rollout(self, records, timer: PhaseTimer, kinds: tuple[str, ...], round_index: int = 0):
        """One train -> rollout -> train transition and a rollout per kind: "sample" (rollout.n sampled
        responses), "greedy" (one at temperature 0: ReMax's baseline), "val" (one at rollout.val_temperature)."""
        c = self.c
        prompts = [r.prompt_ids for r in records]
        with timer.phase("reshard"):
            c.rollout_weights = c.weight_sync.to_rollout()
            c.rollout.set_weights(c.rollout_weights)
        seed = self._rollout_seed(round_index)
        params = {
            "sample": self._sampling(False, seed),
            "greedy": self._sampling(True, seed, temperature=0.0),
            "val": self._sampling(True, seed),
            "val_sample": replace(self._sampling(False, seed), n=self.cfg.rollout.val_n, log_probs=False),
        }
        outs = []
        for kind in kinds:
            with timer.phase("gen"):
                outs.append(rollout_replica(c.rollout, c.rollout_weights, prompts, params[kind]))
            self._add_engine_stats(c.rollout.last_stats)
        with timer.phase("reshard"):
            c.weight_sync.to_train()
            c.rollout_weights = None
        return outs

    def _add_engine_stats(self, stats: dict) -> None:
        """Keep the rollout engine's statistics of one call for the step's metrics (`rollout_engine/<key>`):
        seconds (keys ending in `_s`, e.g. vLLM's `wake_load_s` and `sleep_s`) add up over the step's calls,
        counts are the last call's (native: `decode_steps`, `compactions`, `chunks`, ...)."""
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                name = f"rollout_engine/{key}"
                add = key.endswith("_s") and name in self.engine_stats
                self.engine_stats[name] = float(value) + (self.engine_stats[name] if add else 0.0)

    def _score(
        self, out: RolloutOutput, records, n: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """Reward-function scores (rows,), the overlong penalty (rows,) or None, and the reward function's
        numeric extras {key: (rows,)} (engine/rewards/reward_fn.py)."""
        tok, alg = self.c.tokenizer, self.cfg.algorithm
        lengths = out.response_mask.sum(-1)
        texts = [
            tok.decode(out.response_ids[r, : int(lengths[r])].tolist(), skip_special_tokens=True)
            for r in range(out.response_ids.shape[0])
        ]
        rec = [records[r // n] for r in range(len(texts))]
        scores, extras = torch.zeros(len(texts), dtype=torch.float32), {}
        if self.c.reward_fn is not None:
            result = self.c.reward_fn.score(
                [x.data_source for x in rec],
                texts,
                [x.ground_truth for x in rec],
                [x.extra_info for x in rec],
            )
            scores, extras = result.scores, result.extras
        if self.c.reward_model is not None:  # combine=model: alone; combine=sum: added to the rule score
            prompts = [r.prompt_ids for r in records]
            scores = scores + self.c.reward_model(
                prompts, out.response_ids, out.response_mask, n, self.batcher
            )
        penalty = None
        if overlong_buffer_tokens(alg, self.cfg.rollout.max_new_tokens) > 0:
            penalty = overlong_penalty(
                lengths,
                max_len=self.cfg.rollout.max_new_tokens,
                buffer_len=overlong_buffer_tokens(alg, self.cfg.rollout.max_new_tokens),
                penalty_factor=alg.overlong_penalty,
            ).to(scores.dtype)
        return scores, penalty, extras

    def _responses(self, records, timer: PhaseTimer, round_index: int) -> Responses:
        """Roll out and score one batch of prompts (with ReMax's greedy baseline when needed)."""
        n = self.cfg.rollout.n
        greedy = advantage_traits(self.cfg.algorithm.adv_estimator).needs_greedy_baseline
        outs = self._rollout(records, timer, ("sample", "greedy") if greedy else ("sample",), round_index)
        with timer.phase("reward"):
            scores, penalty, extras = self._score(outs[0], records, n)
            baseline = None
            if greedy:
                greedy, greedy_penalty, _ = self._score(outs[1], records, 1)
                if greedy_penalty is not None:
                    greedy = greedy + greedy_penalty
                baseline = greedy.repeat_interleave(n)
        out = outs[0]
        return Responses(
            records=list(records),
            n=n,
            response_ids=out.response_ids,
            response_mask=out.response_mask,
            log_probs=out.log_probs,
            finished=torch.tensor([r == "stop" for r in out.finish_reasons], dtype=torch.float32),
            scores=scores,
            overlong_penalty=penalty,
            baseline_scores=baseline,
            reward_extras=extras,
        )

    def _collect(self, timer: PhaseTimer) -> tuple[Responses, dict[str, float]]:
        """This replica's responses for the step; with dynamic sampling, further rounds while the batch lacks
        informative groups, selected over all replicas' responses (engine/dynamic_sampling.py)."""
        alg, g = self.cfg.algorithm, self.c.groups
        if not alg.dynamic_sampling:
            return self._responses(self.c.loader.next_batch(), timer, 0), {}
        selector = GroupSelector(self.cfg.data.batch_size)
        rounds = 0
        while True:
            parts: list[Responses | None] = [None] * g.dims.dp
            mine = self._responses(self.c.loader.next_batch(), timer, rounds)
            dist.all_gather_object(parts, mine, group=g.dp)
            selector.add(global_order(parts, alg.num_mini_batches))
            rounds += 1
            missing = torch.tensor(float(selector.missing), device=g.device)
            dist.all_reduce(missing, op=dist.ReduceOp.MAX, group=g.world)
            if float(missing) == 0 or rounds >= alg.max_sampling_rounds:
                break
        batch, counts = selector.finish()  # the same on every replica: counts are global
        responses = replica_share(batch, g.dp_rank, g.dims.dp, alg.num_mini_batches)
        return responses, {
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/generated_groups": float(counts["generated"]),
            "dynamic_sampling/dropped_groups": float(counts["dropped"]),
            "dynamic_sampling/filler_groups": float(counts["filler"]),
        }

    def _experience(self, resp: Responses) -> Experience:
        g = self.c.groups
        first_group = g.dp_rank * resp.num_groups  # group ids unique over replicas and refill rounds
        exp = build_experience(
            [r.prompt_ids for r in resp.records],
            resp.response_ids,
            resp.response_mask,
            list(range(first_group, first_group + resp.num_groups)),
            resp.n,
            self.c.tokenizer.pad_token_id,
            seq_multiple=g.dims.seq_multiple,
        )
        exp.tensors.update(finished=resp.finished, scores=resp.scores)
        if self.rollout_log_probs:
            exp.tensors["rollout_log_probs"] = resp.log_probs
        if resp.overlong_penalty is not None:
            exp.tensors["overlong_penalty"] = resp.overlong_penalty
        if resp.baseline_scores is not None:
            exp.tensors["baseline_scores"] = resp.baseline_scores
        exp.tensors.update({f"{REWARD_EXTRA}{k}": v for k, v in resp.reward_extras.items()})
        return exp

    # ---- advantages and updates -----------------------------------------------------------------
    def _advantages(self, exp: Experience) -> dict[str, float]:
        alg, g = self.cfg.algorithm, self.c.groups
        kl_coef = self.kl_ctrl.value
        exp.tensors.update(compute_advantages(exp, alg, kl_coef, dp_sum(g.dp, g.device)))
        mask = exp.response_mask.bool()
        mean, std, lo, hi = self._stats(exp.tensors["advantages"][mask])
        out = {"actor/adv_mean": mean, "actor/adv_std": std, "actor/adv_min": lo, "actor/adv_max": hi}
        if alg.kl_in_reward:
            kl_seq = exp.tensors["kl_seq"]
            moments = torch.tensor([float(kl_seq.double().sum()), float(kl_seq.numel())], device=g.device)
            dist.all_reduce(moments, group=g.dp)
            current_kl = float(moments[0]) / max(float(moments[1]), 1.0)
            self.kl_ctrl.update(current_kl, n_steps=int(moments[1]))
            out["actor/reward_kl_penalty"] = current_kl
            out["actor/reward_kl_coef"] = kl_coef
        return out

    def _update_actor(self, exp: Experience) -> dict[str, float]:
        alg = self.cfg.algorithm
        keys = ["advantages"]
        if self.rollout_log_probs:
            keys.append("rollout_log_probs")
        if self.needs_old_forward:
            keys.append("old_log_probs")
        if self.kl_ref:
            keys.append("ref_log_probs")
        out = run_updates(
            self.c.actor,
            exp,
            alg=alg,
            make_loss=lambda norm: make_actor_loss(alg, norm, self.kl_ref, self.rollout_log_probs),
            metric_names=actor_metric_names(self.rollout_log_probs),
            keys=tuple(keys),
            batcher=self.batcher,
            max_len=self.cfg.rollout.max_new_tokens,
            seed=self.cfg.trainer.seed + self.step,
            temperature=self.cfg.rollout.temperature,
            first_only=ACTOR_FIRST_MINI_BATCH_METRICS,
        )
        return {f"actor/{k}": v for k, v in out.items()}

    def _update_critic(self, exp: Experience) -> dict[str, float]:
        alg = self.cfg.algorithm
        out = run_updates(
            self.c.critic,
            exp,
            alg=alg,
            make_loss=lambda norm: make_critic_loss(alg, norm),
            metric_names=CRITIC_METRICS,
            keys=("values", "returns"),
            batcher=self.batcher,
            max_len=self.cfg.rollout.max_new_tokens,
            seed=self.cfg.trainer.seed + self.step,
        )
        metrics = {f"critic/{k}": v for k, v in out.items()}
        mask = exp.response_mask.bool()
        metrics["critic/returns_mean"] = self._stats(exp.tensors["returns"][mask])[0]
        metrics["critic/values_mean"] = self._stats(exp.tensors["values"][mask])[0]
        return metrics

    # ---- one step -------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        c, g, T = self.c, self.c.groups, self.cfg.rollout.temperature
        timer = PhaseTimer(g.device)
        if g.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(g.device)
        start = time.perf_counter()
        self.engine_stats = {}
        responses, sampling_metrics = self._collect(timer)
        exp = self._experience(responses)
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
        with timer.phase("adv"):
            adv_metrics = self._advantages(exp)
        critic_metrics = {}
        if c.critic is not None:
            with timer.phase("update_critic"), self.critic_optim_offload.onloaded():
                critic_metrics = self._update_critic(exp)
        with timer.phase("update_actor"), self.actor_optim_offload.onloaded():
            actor_metrics = self._update_actor(exp)
        timer.seconds["step"] = time.perf_counter() - start
        self.step += 1
        self.last_experience = exp
        metrics = {
            **self._rollout_metrics(exp),
            **sampling_metrics,
            **adv_metrics,
            **critic_metrics,
            **actor_metrics,
            **timer.as_metrics(),
            **self.engine_stats,
        }
        metrics.update(self._perf_metrics(exp, timer.seconds, timer.peak_gb))
        metrics["data/epoch"] = c.loader.epoch
        return metrics

    # ---- metrics ------------------------------------------------------------------------------
    def _stats(self, values: torch.Tensor) -> tuple[float, float, float, float]:
        """Mean, std, min, max of `values` (any shape, possibly empty on some replica) over all DP replicas
        (each replica counted once)."""
        g = self.c.groups
        v = values.double().flatten()
        moments = torch.tensor(
            [float(v.sum()), float((v * v).sum()), float(v.numel())], dtype=torch.float64, device=g.device
        )
        ext = torch.tensor(
            [float(-v.min()) if v.numel() else -torch.inf, float(v.max()) if v.numel() else -torch.inf],
            dtype=torch.float64,
            device=g.device,
        )
        dist.all_reduce(moments, group=g.dp)
        dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=g.dp)
        total, sq, count = moments.tolist()
        count = max(count, 1.0)
        mean = total / count
        return mean, max(sq / count - mean * mean, 0.0) ** 0.5, -float(ext[0]), float(ext[1])

    def _rollout_metrics(self, exp: Experience) -> dict[str, float]:
        out = {}
        for name, values in (
            ("reward", exp.tensors["scores"]),
            ("response_length", exp.response_mask.sum(-1)),
        ):
            mean, std, lo, hi = self._stats(values)
            out.update({f"{name}/mean": mean, f"{name}/std": std, f"{name}/min": lo, f"{name}/max": hi})
        out["response_length/clip_ratio"] = self._stats(1.0 - exp.tensors["finished"])[0]
        if "overlong_penalty" in exp.tensors:
            out["reward/overlong_penalty_mean"] = self._stats(exp.tensors["overlong_penalty"])[0]
        if self.rollout_log_probs:
            mask = exp.response_mask.bool()
            out["rollout/logprob_mean"] = self._stats(exp.tensors["rollout_log_probs"][mask])[0]
        out.update(self._reward_extra_metrics(exp))
        return out

    def _reward_extra_metrics(self, exp: Experience) -> dict[str, float]:
        """`reward/extra/<key>`: mean over the DP replicas' rows of each numeric extra of a dict-returning
        reward function (the union of the replicas' keys: a replica without one contributes no rows)."""
        g = self.c.groups
        keys = sorted(k.removeprefix(REWARD_EXTRA) for k in exp.tensors if k.startswith(REWARD_EXTRA))
        if g.dims.dp > 1:
            gathered = [None] * g.dims.dp
            dist.all_gather_object(gathered, keys, group=g.dp)
            keys = sorted(set().union(*gathered))
        empty = torch.zeros(0)
        return {
            f"reward/extra/{k}": self._stats(exp.tensors.get(f"{REWARD_EXTRA}{k}", empty))[0] for k in keys
        }

    def _perf_metrics(
        self, exp: Experience, seconds: dict[str, float], peak_gb: dict[str, float]
    ) -> dict[str, float]:
        g, c = self.c.groups, self.c
        response_lens = exp.response_mask.sum(-1).long()
        seq_lens = exp.prompt_lens + response_lens
        # the actor's head is "response": logits at response positions only
        flops = train_flops(c.shape, seq_lens, response_lens) * self.cfg.algorithm.ppo_epochs
        sums = torch.tensor([float(seq_lens.sum()), flops], dtype=torch.float64, device=g.device)
        dist.all_reduce(sums, group=g.dp)
        tokens, flops = sums.tolist()
        world = g.dims.world_size
        out = {
            "perf/total_tokens": tokens,
            "perf/tokens_per_s_per_gpu": tokens / seconds["step"] / world,
            "perf/mfu/actor": 0.0,
        }
        if g.device.type == "cuda":
            peak = self.cfg.cluster.peak_tflops
            out["perf/mfu/actor"] = mfu(flops, seconds["update_actor"], world, peak)
            # PhaseTimer resets the peak at each phase start: the step's peak is the largest of the phases'
            # and of what ran since the last one started
            since_last = torch.cuda.max_memory_allocated(g.device) / 2**30
            out["perf/max_memory_allocated_gb"] = max([since_last, *peak_gb.values()])
        return out

    def validate(self) -> dict[str, float]:
        """Validation rewards (engine/validation.py): at rollout.val_temperature, overall and per data source,
        and with rollout.val_n = k > 1 mean@k, best@k and maj@k of k sampled responses per prompt."""
        c, k = self.c, self.cfg.rollout.val_n
        timer = PhaseTimer(c.groups.device)
        scores, per_prompt = [], []
        for records in c.val_batches:
            outs = self._rollout(records, timer, ("val", "val_sample") if k > 1 else ("val",))
            values = {"reward": self._score(outs[0], records, 1)[0]}
            scores.append(values["reward"])
            if k > 1:
                sampled = self._score(outs[1], records, k)[0]
                answers = None
                if self.cfg.reward.fn == "" and c.reward_model is None:
                    texts = decode_responses(c.tokenizer, outs[1].response_ids, outs[1].response_mask)
                    sources = [records[i // k].data_source for i in range(len(texts))]
                    answers = response_answers(sources, texts, self.cfg.reward.gsm8k_method)
                values.update(sample_metrics(sampled.view(len(records), k), answers))
            per_prompt.append(([r.data_source for r in records], values))
        mean, std, _, _ = self._stats(torch.cat(scores))
        return {
            "val/reward_mean": mean,
            "val/reward_std": std,
            **per_source_means(per_prompt, c.groups.dp),
            "timing/testing": sum(timer.seconds.values()),
        }

    def fit(self) -> None:
        c, t = self.c, self.cfg.trainer
        try:
            checkpointer = Checkpointer(c, stateful={"kl_ctrl": self.kl_ctrl})
            self.step = checkpointer.resume()
            c.logger.resume_at(self.step)
            self.ref_offload.offload()
            save_metrics: dict[str, float] = {}  # the save after a step, logged on the next step's line
            while self.step < t.total_steps:
                metrics = self.train_step()
                if (
                    t.test_freq
                    and (self.step % t.test_freq == 0 or self.step == t.total_steps)
                    and c.val_batches
                ):
                    metrics.update(self.validate())
                metrics.update(save_metrics)
                c.logger.log(self.step, metrics)  # written before the save: a kill during it keeps the line
                save_metrics = checkpointer.after_step(self.step)
            checkpointer.finish(self.step)
            if t.export_hf:
                export_after_fit(c, self.step)
        finally:
            c.logger.close()
