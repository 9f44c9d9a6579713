"""Keys a combination of settings ignores: one warning line each, printed in the run header."""

from __future__ import annotations

from dataclasses import fields
from functools import reduce

from algorithms.advantages import advantage_traits
from algorithms.kl import KL_CONTROLLERS_WITH_TARGET
from algorithms.losses import policy_loss_traits
from engine.config import MultiTurnConfig, TrainConfig
from engine.config_rules import max_response_tokens, needs_reference, overlong_buffer_tokens

Rule = tuple[str, bool, str]
"""(key, whether this combination of settings ignores it, why)."""


def _ignored_key_rules(cfg: TrainConfig) -> list[Rule]:
    """The rules of every key that only some runs read, grouped as the config is."""
    return _algorithm_rules(cfg) + _run_rules(cfg) + _rollout_rules(cfg) + _multi_turn_rules(cfg)


def _algorithm_rules(cfg: TrainConfig) -> list[Rule]:
    """algorithm.* and critic.*: the estimator, the KL terms, the loss."""
    a = cfg.algorithm
    adv = advantage_traits(a.adv_estimator)
    no_critic = not adv.needs_critic
    gae_only = "only algorithm.adv_estimator=gae (PPO) has a critic"
    kl_rewardless = "it drives the KL-in-reward coefficient, and algorithm.kl_in_reward=false"
    no_target = not a.kl_in_reward or a.kl_ctrl not in KL_CONTROLLERS_WITH_TARGET
    return [
        ("critic.path", no_critic, gae_only),
        ("critic.lr", no_critic, gae_only),
        ("critic.lr_warmup_steps", no_critic, gae_only),
        ("algorithm.value_clip", no_critic, gae_only),
        ("algorithm.lam", not adv.uses_lam, "GAE's lambda: only algorithm.adv_estimator=gae reads it"),
        (
            "algorithm.gamma",
            not adv.uses_gamma,
            f"algorithm.adv_estimator={a.adv_estimator} scores whole responses (no discounting)",
        ),
        (
            "algorithm.norm_adv_by_std",
            not adv.uses_norm_by_std,
            "only algorithm.adv_estimator=grpo divides by the group std",
        ),
        ("algorithm.kl_ctrl", not a.kl_in_reward, kl_rewardless),
        (
            "algorithm.kl_target",
            no_target,
            "only algorithm.kl_ctrl=adaptive",
        ),
        (
            "algorithm.kl_horizon",
            no_target,
            "only algorithm.kl_ctrl=adaptive",
        ),
        (
            "algorithm.kl_estimator",
            a.kl_loss_coef == 0 and not a.kl_in_reward,
            "no KL is computed (algorithm.kl_loss_coef=0, algorithm.kl_in_reward=false)",
        ),
        (
            "algorithm.clip_ratio_c",
            not policy_loss_traits(a.policy_loss).dual_clip,
            f"algorithm.policy_loss={a.policy_loss} has no dual clip",
        ),
        (
            "algorithm.overlong_penalty",
            overlong_buffer_tokens(a, max_response_tokens(cfg.rollout)) == 0,
            "no overlong buffer (algorithm.overlong_buffer_len=0, overlong_buffer_frac=0)",
        ),
        ("algorithm.max_sampling_rounds", not a.dynamic_sampling, "algorithm.dynamic_sampling=false"),
        (
            "algorithm.tis_mode",
            a.tis_cap == 0,
            "algorithm.tis_cap=0: no importance correction between rollout and training log-probs",
        ),
        (
            "trainer.offload_reference",
            not needs_reference(a),
            "no reference policy is built (algorithm.kl_loss_coef=0, algorithm.kl_in_reward=false)",
        ),
    ]


def _run_rules(cfg: TrainConfig) -> list[Rule]:
    """trainer.*, data.*, optim.*, reward.*, cluster.*, placement.*: the run around the algorithm."""
    d, t, p = cfg.data, cfg.trainer, cfg.placement
    own_critic_ranks = p.mode == "split" and p.critic_ranks > 0
    critic_why = (
        "only a critic on ranks of its own (placement.mode=split, placement.critic_ranks > 0) has its own "
        "layout; otherwise it trains in the actor's (parallel.tp, parallel.pp)"
    )
    return [
        (
            "trainer.test_freq",
            bool(d.train_files) and not d.val_files and t.test_freq > 0,
            "data.val_files is empty (the embedded validation set goes with the embedded task only)",
        ),
        (
            "trainer.micro_batch_size",
            t.max_tokens_per_micro_batch > 0,
            "trainer.max_tokens_per_micro_batch cuts the micro-batches by its token budget",
        ),
        ("optim.min_lr", cfg.optim.lr_decay == "constant", "optim.lr_decay=constant never decays to it"),
        ("trainer.max_checkpoints", t.save_freq == 0, "trainer.save_freq=0: no checkpoints"),
        ("data.embedded_task", bool(d.train_files), "data.train_files is set"),
        ("data.embedded_digits", bool(d.train_files), "data.train_files is set"),
        ("reward.combine", not cfg.reward.model_path, "no reward.model_path"),
        ("cluster.peak_tflops", cfg.cluster.device == "cpu", "no MFU is computed on CPU"),
        ("placement.critic_tp", not own_critic_ranks, critic_why),
        ("placement.critic_pp", not own_critic_ranks, critic_why),
    ]


def _rollout_rules(cfg: TrainConfig) -> list[Rule]:
    """rollout.*: the weight transition, the backend's memory, validation sampling."""
    r, t = cfg.rollout, cfg.trainer
    split = cfg.placement.mode == "split"
    split_why = (
        "placement.mode=split: the rollout ranks keep their own weights, sent by parallel/split_transfer.py"
    )
    no_validation = t.test_freq == 0 and not t.val_before_train
    no_validation_why = "trainer.test_freq=0 and trainer.val_before_train=false: no validation"
    val_sampling_why = no_validation_why if no_validation else "rollout.val_temperature=0: greedy validation"
    return [
        ("rollout.keep_rollout_weights", r.weight_sync == "naive", "rollout.weight_sync=naive gathers anew"),
        ("rollout.weight_sync", split, split_why),
        ("rollout.keep_rollout_weights", split, split_why),
        ("rollout.gpu_memory_utilization", r.backend != "vllm", "only rollout.backend=vllm reads it"),
        (
            "rollout.kv_cache_memory_fraction",
            r.backend != "native" or cfg.cluster.device != "cuda",
            "only rollout.backend=native on cluster.device=cuda reads it",
        ),
        ("rollout.val_temperature", no_validation, no_validation_why),
        ("rollout.val_n", no_validation, no_validation_why),
        *(
            (key, no_validation or r.val_temperature == 0, val_sampling_why)
            for key in ("rollout.val_top_p", "rollout.val_top_k")
        ),
    ]


def _multi_turn_rules(cfg: TrainConfig) -> list[Rule]:
    """rollout.multi_turn.*: every key but `enable` is read only by multi-turn episodes."""
    off = not cfg.rollout.multi_turn.enable
    return [
        (f"rollout.multi_turn.{f.name}", off, "rollout.multi_turn.enable=false")
        for f in fields(MultiTurnConfig)
        if f.name != "enable"
    ]


def ignored_key_warnings(cfg: TrainConfig) -> list[str]:
    """One warning line per key set to a value other than the schema's default that this run ignores (the
    entry point prints them once, on rank 0, in the run header)."""
    default = TrainConfig()
    lines = []
    for key, ignored, why in _ignored_key_rules(cfg):
        value = _value(cfg, key)
        if ignored and value != _value(default, key):
            lines.append(f"warning: {key}={value!r} is ignored: {why}")
    return lines


def _value(cfg: TrainConfig, key: str) -> object:
    """The value of a dotted key, at any depth (rollout.multi_turn.max_turns)."""
    return reduce(getattr, key.split("."), cfg)
