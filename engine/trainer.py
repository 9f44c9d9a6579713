"""The RL loop: for each step, rollout -> reward -> (old/ref log-probs) -> advantages -> actor update -> metrics.

Phases and their `timing/<phase>` names follow DESIGN.md's data flow. Model roles, the weight transition, the
rollout engine, data and rewards are built by engine/setup.py; this module only sequences them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from algorithms import get_advantage_estimator, loss_normalizer
from engine.batch import Experience, build_experience, micro_batches
from engine.metrics import PhaseTimer
from engine.role_losses import ACTOR_METRICS, log_prob_fn, make_actor_loss
from engine.rollout.base import SamplingParams
from engine.rollout_phase import rollout_replica
from engine.setup import Components


class Trainer:
    """Runs `trainer.total_steps` RL steps over `Components` built for this rank."""

    def __init__(self, c: Components):
        self.c = c
        self.cfg = c.cfg
        self.step = 0
        alg = self.cfg.algorithm
        self.needs_old_forward = alg.ppo_epochs > 1 or alg.num_mini_batches > 1
        self.kl_ref = c.reference is not None

    # ---- phases ---------------------------------------------------------------------------
    def _sampling(self, greedy: bool, seed: int) -> SamplingParams:
        r, tok = self.cfg.rollout, self.c.tokenizer
        return SamplingParams(
            n=1 if greedy else r.n,
            temperature=r.val_temperature if greedy else r.temperature,
            top_p=1.0 if greedy else r.top_p,
            top_k=0 if greedy else r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=(tok.eos_token_id,),
            ignore_eos=r.ignore_eos,
            seed=seed,
        )

    def _rollout_seed(self) -> int:
        g = self.c.groups
        weights = self.c.rollout_weights
        return (
            self.cfg.trainer.seed * 1_000_003 + self.step * 7919 + g.dp_rank * 104_729 + weights.micro_dp_rank
        ) % (2**62)

    def _generate(self, records, timer: PhaseTimer, greedy: bool = False) -> Experience:
        c = self.c
        prompts = [r.prompt_ids for r in records]
        with timer.phase("reshard"):
            c.rollout_weights = c.weight_sync.to_rollout()
            c.rollout.set_weights(c.rollout_weights)
        with timer.phase("gen"):
            out = rollout_replica(
                c.rollout, c.rollout_weights, prompts, self._sampling(greedy, self._rollout_seed())
            )
        with timer.phase("reshard"):
            c.weight_sync.to_train()
            c.rollout_weights = None
        n = 1 if greedy else self.cfg.rollout.n
        exp = build_experience(
            prompts,
            out.response_ids,
            out.response_mask,
            out.log_probs,
            [r.index for r in records],
            n,
            c.tokenizer.pad_token_id,
            seq_multiple=c.groups.dims.tp if c.groups.dims.sp else 1,
        )
        exp.tensors["rollout_log_probs"] = out.log_probs
        exp.tensors["finished"] = torch.tensor([r == "stop" for r in out.finish_reasons], dtype=torch.float32)
        return exp

    def _score(self, exp: Experience, records, n: int) -> None:
        tok = self.c.tokenizer
        texts = [
            tok.decode(
                exp.response_ids[r, : int(exp.response_mask[r].sum())].tolist(), skip_special_tokens=True
            )
            for r in range(exp.num_rows)
        ]
        rec = [records[r // n] for r in range(exp.num_rows)]
        exp.tensors["scores"] = self.c.reward_fn(
            [x.data_source for x in rec], texts, [x.ground_truth for x in rec], [x.extra_info for x in rec]
        )

    def _forward_log_probs(self, role, exp: Experience) -> torch.Tensor:
        rows = torch.arange(exp.num_rows)
        mbs = micro_batches(exp, rows, self.cfg.trainer.micro_batch_size, (), self.c.groups.device)
        outs = role.run(mbs, log_prob_fn, forward_only=True, temperature=self.cfg.rollout.temperature)
        local = torch.cat([o["log_probs"] for o in outs]).cpu() if outs else None
        shape = tuple(exp.response_ids.shape)
        result = role.broadcast_from_last_stage(
            None if local is None else local.to(self.c.groups.device), shape, torch.float32
        )
        return result.cpu()

    def _advantages(self, exp: Experience) -> None:
        alg = self.cfg.algorithm
        estimator = get_advantage_estimator(alg.adv_estimator)
        adv, _ = estimator(
            mask_bt=exp.response_mask,
            scores_b=exp.tensors["scores"],
            group_index_b=exp.group_index,
            token_rewards_bt=None,
            gamma=alg.gamma,
            lam=alg.lam,
            norm_by_std=alg.norm_adv_by_std,
        )
        exp.tensors["advantages"] = adv

    def _update_actor(self, exp: Experience) -> dict[str, float]:
        c, alg, g = self.c, self.cfg.algorithm, self.c.groups
        keys = ["advantages", "rollout_log_probs"]
        if self.needs_old_forward:
            keys.append("old_log_probs")
        if self.kl_ref:
            keys.append("ref_log_probs")
        sums = torch.zeros(len(ACTOR_METRICS) + 1, dtype=torch.float64)
        grad_norms, lrs = [], []
        rows_per_mini = exp.num_rows // alg.num_mini_batches
        gen = torch.Generator().manual_seed(self.cfg.trainer.seed + self.step)
        for _ in range(alg.ppo_epochs):
            order = torch.randperm(alg.num_mini_batches, generator=gen)  # whole groups stay together
            for mini in order.tolist():
                rows = torch.arange(mini * rows_per_mini, (mini + 1) * rows_per_mini)
                norm = torch.tensor(
                    loss_normalizer(
                        exp.response_mask[rows], alg.loss_agg_mode, max_len=self.cfg.rollout.max_new_tokens
                    ),
                    dtype=torch.float64,
                    device=g.device,
                )
                dist.all_reduce(norm, group=g.dp)
                loss_fn = make_actor_loss(alg, float(norm), g.tp, self.kl_ref)
                mbs = micro_batches(exp, rows, self.cfg.trainer.micro_batch_size, tuple(keys), g.device)
                outs = c.actor.run(mbs, loss_fn, forward_only=False, temperature=self.cfg.rollout.temperature)
                for o in outs:
                    sums += torch.tensor(
                        [float(o[k]) for k in ACTOR_METRICS] + [float(o["tokens"])], dtype=torch.float64
                    )
                stats = c.actor.optimizer_step()
                grad_norms.append(stats.grad_norm)
                lrs.append(stats.lr)
        # metrics live on the last PP stage, once per TP group: sum them onto every rank
        if not (g.is_last_stage and g.tp_rank == 0):
            sums.zero_()
        sums = sums.to(g.device)
        dist.all_reduce(sums)
        sums = sums.cpu()
        tokens = max(float(sums[-1]), 1.0)
        num_updates = alg.ppo_epochs * alg.num_mini_batches
        out = {f"actor/{k}": float(sums[i]) / tokens for i, k in enumerate(ACTOR_METRICS)}
        out["actor/pg_loss"] = float(sums[0]) / num_updates
        out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["actor/lr"] = lrs[-1]
        return out

    # ---- one step -------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        c, g, n = self.c, self.c.groups, self.cfg.rollout.n
        timer = PhaseTimer(g.device)
        if g.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(g.device)
        start = time.perf_counter()
        records = c.loader.next_batch()
        exp = self._generate(records, timer)
        with timer.phase("reward"):
            self._score(exp, records, n)
        if self.needs_old_forward:
            with timer.phase("old_log_prob"):
                exp.tensors["old_log_probs"] = self._forward_log_probs(c.actor, exp)
        if self.kl_ref:
            with timer.phase("ref"):
                exp.tensors["ref_log_probs"] = self._forward_log_probs(c.reference, exp)
        with timer.phase("adv"):
            self._advantages(exp)
        with timer.phase("update_actor"):
            actor_metrics = self._update_actor(exp)
        timer.seconds["step"] = time.perf_counter() - start
        self.step += 1
        metrics = {**self._rollout_metrics(exp), **actor_metrics, **timer.as_metrics()}
        metrics.update(self._perf_metrics(exp, timer.seconds["step"]))
        metrics["data/epoch"] = c.loader.epoch
        return metrics

    def _replica_stats(self, values: torch.Tensor) -> tuple[float, float, float, float]:
        """Mean, std, min, max of per-row values over all DP replicas (each replica counted once)."""
        g = self.c.groups
        v = values.double()
        moments = torch.tensor(
            [v.sum(), (v * v).sum(), float(v.numel())], dtype=torch.float64, device=g.device
        )
        ext = torch.tensor([-v.min(), v.max()], dtype=torch.float64, device=g.device)
        dist.all_reduce(moments, group=g.dp)
        dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=g.dp)
        total, sq, count = moments.tolist()
        mean = total / count
        return mean, max(sq / count - mean * mean, 0.0) ** 0.5, -float(ext[0]), float(ext[1])

    def _rollout_metrics(self, exp: Experience) -> dict[str, float]:
        out = {}
        for name, values in (
            ("reward", exp.tensors["scores"]),
            ("response_length", exp.response_mask.sum(-1)),
        ):
            mean, std, lo, hi = self._replica_stats(values)
            out.update({f"{name}/mean": mean, f"{name}/std": std, f"{name}/min": lo, f"{name}/max": hi})
        out["response_length/clip_ratio"] = self._replica_stats(1.0 - exp.tensors["finished"])[0]
        out["rollout/logprob_mean"] = float(
            (exp.tensors["rollout_log_probs"] * exp.response_mask).sum()
            / exp.response_mask.sum().clamp(min=1)
        )
        return out

    def _perf_metrics(self, exp: Experience, step_s: float) -> dict[str, float]:
        g = self.c.groups
        tokens = torch.tensor(
            float(exp.prompt_lens.sum() + exp.response_mask.sum()), dtype=torch.float64, device=g.device
        )
        dist.all_reduce(tokens, group=g.dp)
        out = {
            "perf/total_tokens": float(tokens),
            "perf/tokens_per_s_per_gpu": float(tokens) / step_s / g.dims.world_size,
        }
        if g.device.type == "cuda":
            out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(g.device) / 2**30
        return out

    def validate(self) -> dict[str, float]:
        """Mean reward over the validation prompts, greedy (or rollout.val_temperature) sampling."""
        c = self.c
        timer = PhaseTimer(c.groups.device)
        scores = []
        for records in c.val_batches:
            exp = self._generate(records, timer, greedy=True)
            self._score(exp, records, 1)
            scores.append(exp.tensors["scores"])
        mean, std, _, _ = self._replica_stats(torch.cat(scores))
        return {"val/reward_mean": mean, "val/reward_std": std, "timing/testing": sum(timer.seconds.values())}

    def fit(self) -> None:
        c, t = self.c, self.cfg.trainer
        try:
            while self.step < t.total_steps:
                metrics = self.train_step()
                if (
                    t.test_freq
                    and (self.step % t.test_freq == 0 or self.step == t.total_steps)
                    and c.val_batches
                ):
                    metrics.update(self.validate())
                c.logger.log(self.step, metrics)
        finally:
            c.logger.close()
