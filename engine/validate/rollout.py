"""The rollout group: sampling, backend and the log-probs the algorithm needs from it."""

from __future__ import annotations

from algorithms.advantages import advantage_traits
from engine.config import ModelConfig, TrainConfig
from engine.validate.built import model_key
from engine.validate.rules import fail, one_of, positive
from parallel.dims import ParallelDims


def validate_rollout(cfg: TrainConfig, dims: ParallelDims, built: ModelConfig) -> None:
    """rollout.*; `built` is the model the run builds (engine/validate/built.py)."""
    r = cfg.rollout
    one_of("rollout.backend", r.backend, ("native", "vllm"))
    positive("rollout.max_num_seqs", r.max_num_seqs)
    one_of("rollout.weight_sync", r.weight_sync, ("hybrid", "naive"))
    if r.weight_sync == "naive" and r.tp != 1:
        fail(
            "rollout.weight_sync",
            "naive",
            "the naive baseline gathers full weights: rollout at TP=1 only",
            "use rollout.weight_sync=hybrid for rollout.tp > 1",
        )
    if r.backend == "vllm" and cfg.cluster.device != "cuda":
        fail("rollout.backend", "vllm", "vLLM needs cluster.device=cuda", "use rollout.backend=native on CPU")
    split = cfg.placement.mode == "split"  # the rollout ranks' own layout: engine/validate/placement.py
    if r.backend == "vllm" and r.tp not in (1, dims.tp) and not split:
        fail(
            "rollout.tp",
            r.tp,
            f"rollout.backend=vllm groups consecutive ranks into its TP groups, which matches the "
            f"3D-HybridEngine's rollout groups only for rollout.tp = 1 or parallel.tp = {dims.tp}",
            f"use rollout.tp=1 or rollout.tp={dims.tp}, or rollout.backend=native",
        )
    if (r.tp < 1 or dims.tp % r.tp) and not split:
        divisors = [d for d in range(1, dims.tp + 1) if dims.tp % d == 0]
        fail("rollout.tp", r.tp, f"must divide parallel.tp={dims.tp}", f"use rollout.tp in {divisors}")
    if r.n < 1:
        fail("rollout.n", r.n, "must be >= 1", "sample at least one response per prompt")
    if advantage_traits(cfg.algorithm.adv_estimator).group_relative and r.n < 2:
        fail(
            "rollout.n",
            r.n,
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares responses within a "
            "group, so it needs at least 2 per prompt",
            "set rollout.n=8 (or >= 2)",
        )
    validate_temperatures(cfg)
    if not 0.0 < r.top_p <= 1.0:
        fail("rollout.top_p", r.top_p, "must lie in (0, 1]", "use 1.0 to turn nucleus sampling off")
    if r.top_k < 0:
        fail("rollout.top_k", r.top_k, "must be >= 0", "use 0 to turn top-k off")
    positive("rollout.max_new_tokens", r.max_new_tokens)
    positive("rollout.val_n", r.val_n)
    if not 0.0 < r.val_top_p <= 1.0:
        fail("rollout.val_top_p", r.val_top_p, "must lie in (0, 1]", "use 1.0 to turn nucleus sampling off")
    if r.val_top_k < 0:
        fail("rollout.val_top_k", r.val_top_k, "must be >= 0", "use 0 to turn top-k off")
    if not 0.0 < r.kv_cache_memory_fraction < 1.0:
        fail("rollout.kv_cache_memory_fraction", r.kv_cache_memory_fraction, "must lie in (0, 1)", "use 0.5")
    if not 0.0 < r.gpu_memory_utilization < 1.0:
        fail("rollout.gpu_memory_utilization", r.gpu_memory_utilization, "must lie in (0, 1)", "use 0.5")
    validate_multi_turn(cfg, built)
    if not r.log_probs:
        validate_without_rollout_log_probs(cfg)
    if r.backend == "vllm" and r.log_probs:
        validate_vllm_log_probs(cfg)


def validate_temperatures(cfg: TrainConfig) -> None:
    """rollout.temperature > 0 (the training forward scores at it), rollout.val_temperature 0 (greedy) or
    positive; a positive one at least `MIN_TEMPERATURE` (engine/rollout/base.py says why)."""
    from engine.rollout.base import MIN_TEMPERATURE

    r = cfg.rollout
    positive("rollout.temperature", r.temperature)
    if r.val_temperature < 0:
        fail("rollout.val_temperature", r.val_temperature, "must be >= 0", "use 0 for greedy validation")
    why = (
        f"must be >= {MIN_TEMPERATURE}: the sampler multiplies float32 logits by 1/temperature, which far below "
        "that overflows to inf and turns the probabilities NaN (vLLM raises any temperature under 0.01 to "
        "0.01); below it sampling is greedy in all but name"
    )
    if r.temperature < MIN_TEMPERATURE:
        fail("rollout.temperature", r.temperature, why, f"set rollout.temperature >= {MIN_TEMPERATURE}")
    if 0 < r.val_temperature < MIN_TEMPERATURE:
        fail(
            "rollout.val_temperature",
            r.val_temperature,
            why,
            f"set rollout.val_temperature=0 for greedy validation, or >= {MIN_TEMPERATURE}",
        )


def validate_multi_turn(cfg: TrainConfig, built: ModelConfig) -> None:
    """rollout.multi_turn.*: limits, tool format and tool names, the room an episode needs, and the embedded
    calculator task's settings."""
    from engine.multi_turn.parsers import tool_format_names
    from engine.multi_turn.tools import TOOLS

    mt, key = cfg.rollout.multi_turn, "rollout.multi_turn"
    calculator_task = cfg.data.embedded_task == "calculator" and not cfg.data.train_files
    if calculator_task and not (mt.enable and mt.tool_format == "compact" and "calculator" in mt.tools):
        fail(
            "data.embedded_task",
            "calculator",
            "the calculator task is multi-turn: the model calls the calculator in the compact tool format",
            f"add {key}.enable=true {key}.tool_format=compact {key}.tools=[calculator]",
        )
    if not mt.enable:
        return
    positive(f"{key}.max_turns", mt.max_turns)
    positive(f"{key}.max_total_tokens", mt.max_total_tokens)
    positive(f"{key}.tool_timeout_s", mt.tool_timeout_s)
    positive(f"{key}.max_tool_result_chars", mt.max_tool_result_chars)
    if mt.sandbox_memory_mb < 64:
        fail(
            f"{key}.sandbox_memory_mb",
            mt.sandbox_memory_mb,
            "must be >= 64 (the interpreter itself)",
            "use 512",
        )
    one_of(f"{key}.tool_format", mt.tool_format, tuple(tool_format_names()))
    if not mt.tools:
        fail(f"{key}.tools", [], "an episode needs at least one tool", f"e.g. {key}.tools=[calculator]")
    for spec in mt.tools:
        if spec not in TOOLS and ":" not in spec:
            fail(
                f"{key}.tools",
                spec,
                f"is neither a built-in tool {sorted(TOOLS)} nor module:function",
                "name a built-in tool or a function, e.g. my_tools:search",
            )
    need = cfg.data.max_prompt_len + mt.max_total_tokens + cfg.rollout.max_new_tokens
    if need > built.max_position_embeddings:
        positions = model_key(cfg, "max_position_embeddings")
        fail(
            f"{key}.max_total_tokens",
            mt.max_total_tokens,
            f"data.max_prompt_len ({cfg.data.max_prompt_len}) + max_total_tokens + rollout.max_new_tokens "
            f"({cfg.rollout.max_new_tokens}) = {need} must fit {positions} "
            f"({built.max_position_embeddings}): every turn's prompt is the episode so far",
            "lower one of them" + ("" if cfg.model.path else " or raise model.max_position_embeddings"),
        )


def validate_vllm_log_probs(cfg: TrainConfig) -> None:
    """vLLM's log-probs are taken before temperature or after top-p/top-k truncation
    (engine/rollout/vllm_backend.py): refuse the sampling settings where neither is the full distribution at the
    temperature, which the training forward computes."""
    from engine.rollout.vllm_backend import full_log_probs_mode

    r = cfg.rollout
    if full_log_probs_mode(r.temperature, r.top_p, r.top_k) is None:
        fail(
            "rollout.temperature",
            r.temperature,
            f"with rollout.backend=vllm and rollout.top_p={r.top_p}, rollout.top_k={r.top_k}, vLLM returns "
            "log-probs either before temperature or over the top-p/top-k truncated distribution, never the "
            "full distribution at the temperature that the training forward computes",
            "set rollout.temperature=1.0, or rollout.top_p=1.0 and rollout.top_k=0, or rollout.log_probs=false "
            "(not with algorithm.tis_cap > 0), or rollout.backend=native",
        )


def validate_without_rollout_log_probs(cfg: TrainConfig) -> None:
    """rollout.log_probs=false: refuse the settings that need the rollout's own log-probs (a KL in the reward
    takes the old-log-prob forward's instead: engine/config_rules.py `needs_old_log_prob_forward`)."""
    a = cfg.algorithm
    if a.tis_cap > 0:
        fail(
            "rollout.log_probs",
            False,
            f"algorithm.tis_cap={a.tis_cap} (truncated importance sampling) weights the loss by the ratio of "
            "training to rollout log-probs, so it needs the rollout's log-probs",
            "set rollout.log_probs=true, or algorithm.tis_cap=0",
        )
