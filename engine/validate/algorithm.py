"""The algorithm group: estimator, policy loss, clipping, KL (loss and reward) and the critic, asked of the
registries' traits."""

from __future__ import annotations

import os

from algorithms.advantages import advantage_estimator_names, advantage_traits
from algorithms.kl import KL_CONTROLLERS, KL_CONTROLLERS_WITH_TARGET, kl_estimator_names
from algorithms.losses import LOSS_AGG_MODES, TIS_MODES, policy_loss_names, policy_loss_traits
from engine.config import ModelConfig, TrainConfig
from engine.config_rules import max_response_tokens, overlong_buffer_tokens
from engine.validate.built import model_key
from engine.validate.model import validate_checkpoint_positions
from engine.validate.rules import fail, one_of, positive


def validate_algorithm(cfg: TrainConfig, built: ModelConfig) -> None:
    """algorithm.*; `built` is the model the run builds (engine/validate/built.py)."""
    a = cfg.algorithm
    one_of("algorithm.adv_estimator", a.adv_estimator, tuple(advantage_estimator_names()))
    one_of("algorithm.policy_loss", a.policy_loss, tuple(policy_loss_names()))
    one_of("algorithm.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES)
    if policy_loss_traits(a.policy_loss).sequence_ratio and a.loss_agg_mode != "seq-mean-token-mean":
        fail(
            "algorithm.loss_agg_mode",
            a.loss_agg_mode,
            f"algorithm.policy_loss={a.policy_loss} clips one ratio per sequence, and its objective is the mean "
            "over sequences (the GSPO paper; verl applies seq-mean-token-mean whatever loss_agg_mode says)",
            "set algorithm.loss_agg_mode=seq-mean-token-mean (algorithm=gspo does)",
        )
    one_of("algorithm.kl_estimator", a.kl_estimator, tuple(kl_estimator_names()))
    one_of("algorithm.kl_ctrl", a.kl_ctrl, KL_CONTROLLERS)
    for key, value in (
        ("algorithm.clip_ratio_low", a.clip_ratio_low),
        ("algorithm.clip_ratio_high", a.clip_ratio_high),
    ):
        positive(key, value)
    if a.clip_ratio_low >= 1.0:
        fail(
            "algorithm.clip_ratio_low",
            a.clip_ratio_low,
            "must be < 1 (the ratio is clipped below at 1 - clip_ratio_low)",
            "use 0.2 (the usual value)",
        )
    if a.clip_ratio_c <= 1.0:
        fail(
            "algorithm.clip_ratio_c",
            a.clip_ratio_c,
            "dual-clip bound must be > 1",
            "use 3.0 (the usual value)",
        )
    if not 0.0 <= a.gamma <= 1.0 or not 0.0 <= a.lam <= 1.0:
        fail(
            "algorithm.gamma/algorithm.lam",
            (a.gamma, a.lam),
            "must lie in [0, 1]",
            "use gamma=1.0, lam=0.95 for PPO",
        )
    for key, value in (
        ("algorithm.kl_loss_coef", a.kl_loss_coef),
        ("algorithm.kl_reward_coef", a.kl_reward_coef),
        ("algorithm.entropy_coef", a.entropy_coef),
        ("algorithm.tis_cap", a.tis_cap),
    ):
        if value < 0:
            fail(key, value, "must be >= 0", f"set {key}=0 to turn it off")
    one_of("algorithm.tis_mode", a.tis_mode, TIS_MODES)
    positive("algorithm.ppo_epochs", a.ppo_epochs)
    positive("algorithm.num_mini_batches", a.num_mini_batches)
    positive("algorithm.max_sampling_rounds", a.max_sampling_rounds)
    validate_kl_in_reward(cfg)
    validate_router_replay(cfg, built)
    if a.value_clip < 0:
        fail("algorithm.value_clip", a.value_clip, "must be >= 0", "use 0.2, or 0 to turn clipping off")
    max_len, len_key = max_response_tokens(cfg.rollout), "rollout.max_new_tokens"
    if cfg.rollout.multi_turn.enable:
        len_key = "rollout.multi_turn.max_total_tokens"
    if a.overlong_buffer_len < 0 or a.overlong_buffer_len > max_len:
        fail(
            "algorithm.overlong_buffer_len",
            a.overlong_buffer_len,
            f"the overlong penalty ramps over the last overlong_buffer_len of {len_key}="
            f"{max_len} tokens, so it must lie in [0, {len_key}]",
            f"set algorithm.overlong_buffer_len<={max_len} (e.g. a quarter of "
            f"{len_key}), use algorithm.overlong_buffer_frac (a fraction of it) with "
            f"overlong_buffer_len=0, raise {len_key}, or use 0 to turn overlong shaping off",
        )
    if not 0.0 <= a.overlong_buffer_frac <= 1.0:
        fail(
            "algorithm.overlong_buffer_frac",
            a.overlong_buffer_frac,
            f"is a fraction of {len_key}, so it must lie in [0, 1]",
            "use 0.2 (DAPO's 4096 of 20480 tokens), or 0 to turn overlong shaping off",
        )
    if a.overlong_penalty < 0:
        fail("algorithm.overlong_penalty", a.overlong_penalty, "must be >= 0", "use 1.0 (DAPO)")
    validate_overlong_on_the_embedded_task(cfg, max_len, len_key)
    if cfg.critic.lr <= 0 or cfg.critic.lr_warmup_steps < 0:
        fail(
            "critic.lr/critic.lr_warmup_steps",
            (cfg.critic.lr, cfg.critic.lr_warmup_steps),
            "the critic's lr must be > 0 and its warm-up >= 0",
            "use e.g. critic.lr=1e-5 critic.lr_warmup_steps=0",
        )
    if cfg.critic.path and not os.path.isdir(cfg.critic.path):
        fail(
            "critic.path",
            cfg.critic.path,
            "is not a directory",
            "point critic.path at a local Hugging Face checkpoint directory, or leave it empty for model.path",
        )
    if cfg.critic.path and advantage_traits(a.adv_estimator).needs_critic:  # else no critic is built
        validate_checkpoint_positions(cfg, "critic.path", cfg.critic.path)


def validate_overlong_on_the_embedded_task(cfg: TrainConfig, max_len: int, len_key: str) -> None:
    """The embedded copy and target tasks' complete answer is data.embedded_digits tokens and the stop token;
    an overlong buffer that reaches into that length penalizes every complete answer (DAPO's preset on the
    default job: 5-token answers, rollout.max_new_tokens=5, a 1-token buffer: score 1, penalty -1), so the
    model learns to stop early instead of answering. (Datasets' answer lengths are not known: not checked.)"""
    a, d = cfg.algorithm, cfg.data
    buffer = overlong_buffer_tokens(a, max_len)
    answer = d.embedded_digits + 1
    if d.train_files or d.embedded_task == "calculator" or buffer == 0 or a.overlong_penalty == 0:
        return
    if max_len - buffer < answer:
        key = "algorithm.overlong_buffer_len" if a.overlong_buffer_len else "algorithm.overlong_buffer_frac"
        # the shortest response budget whose buffer (a fraction of it, or a fixed length) starts after the answer
        room = next(
            (n for n in range(answer, 64 * answer) if n - overlong_buffer_tokens(a, n) >= answer), None
        )
        raise_it = f"raise {len_key} to at least {room}, or " if room else ""
        fail(
            key,
            a.overlong_buffer_len or a.overlong_buffer_frac,
            f"makes the overlong penalty start after {max_len - buffer} of {len_key}={max_len} tokens, but the "
            f"embedded {d.embedded_task} task's complete answer is {answer} tokens (data.embedded_digits="
            f"{d.embedded_digits} and the stop token): every complete answer would be penalized",
            f"{raise_it}set algorithm.overlong_buffer_frac=0 algorithm.overlong_buffer_len=0 (no overlong "
            "shaping)",
        )


def validate_kl_in_reward(cfg: TrainConfig) -> None:
    a = cfg.algorithm
    if not a.kl_in_reward:
        if a.kl_reward_coef > 0:
            fail(
                "algorithm.kl_reward_coef",
                a.kl_reward_coef,
                "has no effect while algorithm.kl_in_reward=false",
                "set algorithm.kl_in_reward=true, or algorithm.kl_reward_coef=0",
            )
        return
    if a.kl_reward_coef <= 0:
        fail(
            "algorithm.kl_reward_coef",
            a.kl_reward_coef,
            "algorithm.kl_in_reward=true needs a positive starting coefficient (the adaptive controller "
            "only multiplies it)",
            "set algorithm.kl_reward_coef=0.001, or algorithm.kl_in_reward=false",
        )
    if a.kl_ctrl in KL_CONTROLLERS_WITH_TARGET and (a.kl_target <= 0 or a.kl_horizon <= 0):
        fail(
            "algorithm.kl_target/algorithm.kl_horizon",
            (a.kl_target, a.kl_horizon),
            "the adaptive KL controller needs both > 0",
            "use algorithm.kl_target=0.1 algorithm.kl_horizon=10000",
        )


def validate_router_replay(cfg: TrainConfig, built: ModelConfig) -> None:
    """algorithm.router_replay: the native rollout of an MoE model records the experts it chose
    (engine/rollout/routes.py) for single-turn, colocated rollouts; the actor's forwards replay them."""
    if not cfg.algorithm.router_replay:
        return
    key, refusals = (
        "algorithm.router_replay",
        (
            (
                built.moe.num_experts == 0,
                f"replays the experts of a mixture-of-experts model, and "
                f"{model_key(cfg, 'moe.num_experts')}=0 (a dense model)",
                "pick an MoE model (e.g. model=tiny_moe) or set algorithm.router_replay=false",
            ),
            (
                cfg.rollout.backend != "native",
                f"needs the rollout's expert choices, which only rollout.backend=native records "
                f"(rollout.backend={cfg.rollout.backend!r})",
                "set rollout.backend=native or algorithm.router_replay=false",
            ),
            (
                cfg.rollout.multi_turn.enable,
                "records the routes of single-turn rollouts only (rollout.multi_turn.enable=true)",
                "set rollout.multi_turn.enable=false or algorithm.router_replay=false",
            ),
            (
                cfg.placement.mode == "split",
                "is not carried from the rollout ranks of placement.mode=split",
                "set placement.mode=colocated or algorithm.router_replay=false",
            ),
            (
                cfg.model.recompute and cfg.parallel.pp > 1,
                "with model.recompute=true and parallel.pp>1 the recomputed forward of a micro-batch would replay "
                "another micro-batch's routes",
                "set model.recompute=false, parallel.pp=1, or algorithm.router_replay=false",
            ),
        ),
    )
    for refused, rule, fix in refusals:
        if refused:
            fail(key, True, rule, fix)
