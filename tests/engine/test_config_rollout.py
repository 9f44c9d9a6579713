"""Config validation of the rollout: vLLM's rules (MoE models, TP groups, log-probs under truncation), routing
replay, rollout log-probs off (no processes, no models)."""

from __future__ import annotations

import pytest
from config_compose import composed

from engine.config import ConfigError
from engine.validate import validate


@pytest.mark.parametrize("preset", ["tiny_moe", "qwen3_30b_a3b", "qwen1_5_moe_a2_7b"])
def test_moe_models_roll_out_on_vllm_unless_vllm_cannot_build_them(preset):
    """rollout.backend=vllm loads MoE presets (engine/rollout/vllm_weights.py) at rollout.tp = parallel.tp = 2;
    refused with the key: an MoE model vLLM has no family for (sigmoid router), an expert width that
    rollout.tp does not divide (vLLM's FusedMoE splits each expert over TP). The model checks only (no GPU
    nor vllm package here)."""
    from engine.validate.model import validate_model, validate_parallel

    def check(*overrides: str, world: int) -> None:
        cfg = composed(f"model={preset}", "data.max_prompt_len=32", "rollout.backend=vllm", *overrides)
        validate_model(cfg, validate_parallel(cfg, world))

    tp2 = ("parallel.tp=2", "parallel.sp=true", "rollout.tp=2")
    check(*tp2, world=2)
    if preset != "tiny_moe":
        return
    with pytest.raises(
        ConfigError, match="rollout.backend='vllm': the MoE model cannot be written as a Hugg"
    ):
        check("model.moe.score_function=sigmoid", world=1)
    with pytest.raises(ConfigError, match="rollout.tp=2: vLLM's FusedMoE splits each expert's width.*=63"):
        check(*tp2, "model.moe.ffn_hidden_size=63", world=2)


def test_router_replay_refuses_vllm():
    """vLLM reports no expert choices (it records no routes)."""
    from engine.validate.algorithm import validate_router_replay

    cfg = composed("model=tiny_moe", "algorithm.router_replay=true", "rollout.backend=vllm")
    with pytest.raises(ConfigError, match="which only rollout.backend=native records"):
        validate_router_replay(cfg, cfg.model)


def test_vllm_needs_rollout_tp_one_or_full():
    """vLLM's TP groups are consecutive ranks; the HybridEngine's are strided unless t_g is 1 or t."""
    from engine.validate.rollout import validate_rollout
    from parallel.dims import ParallelDims

    cfg = composed("rollout.backend=vllm", "rollout.tp=2", "parallel.tp=4")
    cfg.cluster.device = "cuda"  # checked on its own before this rule; pretend a GPU is visible
    with pytest.raises(ConfigError, match="rollout.tp=2"):
        validate_rollout(cfg, ParallelDims(world_size=4, tp=4), cfg.model)
    cfg.rollout.tp = 4
    validate_rollout(cfg, ParallelDims(world_size=4, tp=4), cfg.model)


def test_vllm_on_split_placement_lines_up_with_vllms_tp_groups():
    """Split placement runs rollout.backend=vllm on the rollout ranks; vLLM cuts the whole job into TP groups of
    consecutive ranks, so the training ranks before the rollout ranks must fill whole groups."""
    from engine.validate.placement import validate_placement
    from parallel.dims import ParallelDims

    cfg = composed(
        "placement.mode=split", "placement.rollout_ranks=2", "rollout.backend=vllm", "rollout.tp=2"
    )
    validate_placement(
        cfg, ParallelDims(world_size=2, tp=1), cfg.model
    )  # ranks 0-1 train, 2-3: one vLLM TP group
    with pytest.raises(
        ConfigError, match="rollout.tp=2: with rollout.backend=vllm must divide the 1 training"
    ):
        validate_placement(
            cfg, ParallelDims(world_size=1, tp=1), cfg.model
        )  # vLLM's groups would be [0, 1], [2]


def test_vllm_log_probs_with_truncation_need_temperature_one():
    """vLLM's log-probs are raw (before temperature) or processed (after top-p/top-k truncation): with top-p or
    top-k at T != 1 neither is the full distribution at T, so rollout.log_probs must be off there."""
    from engine.validate.rollout import validate_rollout
    from parallel.dims import ParallelDims

    dims = ParallelDims(world_size=1, tp=1)
    for overrides in (["rollout.top_p=0.9"], ["rollout.top_k=20"], ["rollout.temperature=0.7"]):
        cfg = composed("rollout.backend=vllm", *overrides)
        cfg.cluster.device = "cuda"  # checked on its own before this rule; pretend a GPU is visible
        validate_rollout(cfg, dims, cfg.model)
    cfg = composed("rollout.backend=vllm", "rollout.top_p=0.9", "rollout.temperature=0.7")
    cfg.cluster.device = "cuda"
    with pytest.raises(
        ConfigError, match=r"rollout.temperature=0.7.*rollout.top_p=0.9.*Fix: set rollout.temp"
    ):
        validate_rollout(cfg, dims, cfg.model)
    cfg.rollout.log_probs = False
    validate_rollout(cfg, dims, cfg.model)
    cfg.rollout.backend, cfg.rollout.log_probs = "native", True  # the native sampler gives them at any T
    validate_rollout(cfg, dims, cfg.model)


def test_rollout_log_probs_off_runs_the_old_forward_for_a_kl_in_the_reward_and_refuses_tis():
    """Without rollout log-probs a KL in the reward gets the policy's log-probs from the old-log-prob forward
    (engine/config_rules.py needs_old_log_prob_forward, the rule the trainer applies); only TIS, which needs the
    rollout's own, is refused."""
    from engine.config_rules import needs_old_log_prob_forward

    validate(composed("rollout.log_probs=false"), world_size=1)  # grpo: a KL loss, no TIS
    validate(composed("rollout.log_probs=false", "algorithm=dapo", "rollout.max_new_tokens=6"), world_size=1)
    for extra in ([], ["algorithm.ppo_epochs=2"], ["algorithm.num_mini_batches=2"]):
        cfg = composed("rollout.log_probs=false", "algorithm=ppo", *extra)
        assert needs_old_log_prob_forward(cfg.algorithm, rollout_log_probs=False)
        validate(cfg, world_size=1)
    one_step = composed("algorithm=ppo").algorithm
    assert not needs_old_log_prob_forward(one_step) and needs_old_log_prob_forward(one_step, False)
    assert needs_old_log_prob_forward(one_step, off_policy_steps=1)  # the rollout's weights are a step old
    assert not needs_old_log_prob_forward(composed("algorithm=grpo").algorithm, rollout_log_probs=False)
    with pytest.raises(ConfigError, match=r"algorithm.tis_cap=0\.5.*Fix: set rollout.log_probs=true, or "):
        validate(composed("rollout.log_probs=false", "algorithm.tis_cap=0.5"), world_size=1)


def test_validation_sampling_follows_verls_val_kwargs():
    """rollout.val_temperature, val_top_p, val_top_k and val_n map verl's val_kwargs (temperature, top_p, top_k,
    n): the val_n responses are sampled at the validation settings, not training's; with val_temperature=0
    (greedy, the default) the one val response is greedy and the val_n samples keep training's sampling
    (k greedy responses would be one). Bad values are refused with the key; validation keys a run does not
    read are warned about."""
    from engine.step.rollout import rollout_params
    from engine.validate.ignored import ignored_key_warnings

    train = ("rollout.temperature=1.0", "rollout.top_p=0.95", "rollout.top_k=50", "rollout.val_n=4")
    cfg = composed(*train, "rollout.val_temperature=0.6", "rollout.val_top_p=0.9", "rollout.val_top_k=20")
    validate(cfg, world_size=1)
    params = rollout_params(cfg, (2,), 0, [])
    sample, val, val_sample = params["sample"], params["val"], params["val_sample"]
    assert (sample.temperature, sample.top_p, sample.top_k) == (1.0, 0.95, 50)
    assert (val_sample.n, val_sample.temperature, val_sample.top_p, val_sample.top_k) == (4, 0.6, 0.9, 20)
    assert (val.n, val.temperature, val.top_p, val.top_k) == (1, 0.6, 0.9, 20)
    assert (
        val_sample.seed != val.seed
    )  # vLLM seeds rows by index: the same seed would repeat the val response
    greedy = rollout_params(composed(*train), (2,), 0, [])
    assert greedy["val"].temperature == 0.0
    assert (greedy["val_sample"].temperature, greedy["val_sample"].top_p, greedy["val_sample"].top_k) == (
        1.0,
        0.95,
        50,
    )
    with pytest.raises(ConfigError, match=r"rollout.val_top_p=0\.0.*Fix: use 1.0"):
        validate(composed("rollout.val_top_p=0.0"), world_size=1)
    with pytest.raises(ConfigError, match=r"rollout.val_top_k=-1.*Fix: use 0"):
        validate(composed("rollout.val_top_k=-1"), world_size=1)
    warned = ignored_key_warnings(composed("rollout.val_top_p=0.9", "trainer.test_freq=1"))
    assert any("rollout.val_top_p=0.9 is ignored: rollout.val_temperature=0" in w for w in warned), warned
    warned = ignored_key_warnings(
        composed("rollout.val_top_k=5", "rollout.val_temperature=0.6", "trainer.test_freq=0")
    )
    assert any("rollout.val_top_k=5 is ignored: trainer.test_freq=0" in w for w in warned), warned
    assert not ignored_key_warnings(
        composed("rollout.val_top_k=5", "rollout.val_temperature=0.6", "trainer.test_freq=1")
    )


def test_temperatures_under_the_smallest_are_refused_with_the_bound():
    """A tiny positive temperature used to pass validation and crash the sampler mid-rollout (1 / T overflows
    float32, the probabilities turn NaN, the draw indexes past the vocabulary): refused with the key, the bound
    and why; the bound itself and greedy validation (0) are accepted."""
    import re

    from engine.rollout.base import MIN_TEMPERATURE

    for key in ("rollout.temperature", "rollout.val_temperature"):
        with pytest.raises(
            ConfigError, match=re.escape(f"{key}=1e-40: must be >= {MIN_TEMPERATURE}: the sampler multiplies")
        ) as err:
            validate(composed(f"{key}=1e-40"), world_size=1)
        assert "overflows to inf" in str(err.value) and f"Fix: set {key}" in str(err.value)
        validate(composed(f"{key}={MIN_TEMPERATURE}"), world_size=1)
    validate(composed("rollout.val_temperature=0"), world_size=1)
    with pytest.raises(ConfigError, match="rollout.temperature=0.0: must be > 0"):
        validate(composed("rollout.temperature=0"), world_size=1)
