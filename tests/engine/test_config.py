"""Config composition and validation: every bad value names its key (no processes, no models)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from engine.config import ConfigError, TrainConfig, register_configs, to_dataclass
from engine.validate import validate

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
register_configs()


def composed(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        return to_dataclass(compose(config_name="train", overrides=list(overrides)))


def test_default_config_is_valid():
    cfg = composed()
    dims = validate(cfg, world_size=1)
    assert (dims.tp, dims.pp, dims.dp) == (1, 1, 1)
    assert cfg.algorithm.name == "grpo" and cfg.model.name == "tiny" and cfg.cluster.name == "cpu"


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo"])
def test_presets_compose_and_validate(algorithm):
    validate(composed(f"algorithm={algorithm}"), world_size=1)


def test_unknown_key_fails_at_compose():
    with pytest.raises(Exception, match="trainer.totl_steps|totl_steps"):
        composed("trainer.totl_steps=3")


BAD = [
    # (overrides, world size, text the message must contain)
    (["parallel.tp=3"], 4, "parallel.tp * parallel.pp"),
    (["parallel.tp=2", "parallel.pp=2"], 2, "parallel.tp * parallel.pp"),
    (["parallel.vpp=2"], 1, "parallel.vpp"),
    (["parallel.sp=true"], 1, "parallel.sp"),
    (["data.batch_size=3", "parallel.tp=1"], 2, "data.batch_size"),
    (["trainer.micro_batch_size=5"], 1, "trainer.micro_batch_size"),
    (["algorithm.num_mini_batches=3"], 1, "algorithm.num_mini_batches"),
    (["rollout.n=1"], 1, "rollout.n"),
    (["algorithm.adv_estimator=ppo2"], 1, "algorithm.adv_estimator"),
    (["algorithm.policy_loss=dpo"], 1, "algorithm.policy_loss"),
    (["algorithm.loss_agg_mode=mean"], 1, "algorithm.loss_agg_mode"),
    (["algorithm.kl_estimator=k9"], 1, "algorithm.kl_estimator"),
    (["algorithm.clip_ratio_c=0.5"], 1, "algorithm.clip_ratio_c"),
    (["rollout.tp=3", "parallel.tp=2"], 2, "rollout.tp"),
    (["rollout.backend=sglang"], 1, "rollout.backend"),
    (["rollout.backend=vllm"], 1, "rollout.backend"),
    (["rollout.temperature=0"], 1, "rollout.temperature"),
    (["rollout.top_p=1.5"], 1, "rollout.top_p"),
    (["rollout.top_k=-1"], 1, "rollout.top_k"),
    (["model.num_attention_heads=6", "parallel.tp=4"], 4, "model.num_attention_heads"),
    (["model.num_query_groups=3"], 1, "model.num_query_groups"),
    (["model.num_layers=3", "parallel.pp=2"], 2, "model.num_layers"),
    (["model.path=/nonexistent/ckpt"], 1, "model.path"),
    (["model.dtype=fp8"], 1, "model.dtype"),
    (["data.max_prompt_len=1000"], 1, "data.max_prompt_len + rollout.max_new_tokens"),
    (["data.bad_rows=ignore"], 1, "data.bad_rows"),
    (["optim.lr=0"], 1, "optim.lr"),
    (["optim.lr_decay=step"], 1, "optim.lr_decay"),
    (["optim.min_lr=1"], 1, "optim.min_lr"),
    (["trainer.loggers=[console,mlflow]"], 1, "trainer.loggers"),
    (["trainer.resume=/no/such/checkpoint"], 1, "trainer.resume"),
    (["cluster.device=tpu"], 1, "cluster.device"),
    (["rollout.log_probs=false", "algorithm.tis_cap=2"], 1, "rollout.log_probs=False: algorithm.tis_cap=2.0"),
    (["reward.timeout_s=-1"], 1, "reward.timeout_s=-1.0: must be >= 0"),
    (["reward.fn=score"], 1, "reward.fn='score': expected 'module:function'"),
    (["reward.fn=/no/such/reward.py:score"], 1, "reward.fn='/no/such/reward.py:score': file"),
    (["reward.fn=engine.rewards.gsm8k:no_such_fn"], 1, "has no function 'no_such_fn'"),
    (["reward.fn=no_such_module_x:score"], 1, "reward.fn='no_such_module_x:score': cannot import module"),
]


@pytest.mark.parametrize("overrides,world,needle", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_config_names_the_key(overrides, world, needle):
    cfg = composed(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=world)
    message = str(err.value)
    assert needle in message
    assert "Fix:" in message or "launch" in message or "use" in message


def test_reward_fn_is_imported_during_validation():
    stall_reward = os.path.join(os.path.dirname(__file__), "stall_reward.py")
    validate(composed(f"reward.fn={stall_reward}:score"), world_size=1)
    validate(composed("reward.fn=engine.rewards:rule_reward"), world_size=1)


def test_cli_prints_composed_config():
    out = subprocess.run(
        [sys.executable, "-m", "engine.train", "--cfg", "job", "algorithm=rloo", "rollout.n=4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "adv_estimator: rloo" in out.stdout and "'n': 4" in out.stdout


def test_cli_rejects_bad_config_before_distributed_start():
    out = subprocess.run(
        [sys.executable, "-m", "engine.train", "rollout.n=1"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "rollout.n=1" in out.stderr


def test_vllm_needs_rollout_tp_one_or_full():
    """vLLM's TP groups are consecutive ranks; the HybridEngine's are strided unless t_g is 1 or t."""
    from engine.validate import _validate_rollout
    from parallel.dims import ParallelDims

    cfg = composed("rollout.backend=vllm", "rollout.tp=2", "parallel.tp=4")
    cfg.cluster.device = "cuda"  # checked on its own before this rule; pretend a GPU is visible
    with pytest.raises(ConfigError, match="rollout.tp=2"):
        _validate_rollout(cfg, ParallelDims(world_size=4, tp=4))
    cfg.rollout.tp = 4
    _validate_rollout(cfg, ParallelDims(world_size=4, tp=4))


def test_rollout_log_probs_off_runs_the_old_forward_for_a_kl_in_the_reward_and_refuses_tis():
    """Without rollout log-probs a KL in the reward gets the policy's log-probs from the old-log-prob forward
    (engine/config.py needs_old_log_prob_forward, the rule the trainer applies); only TIS, which needs the
    rollout's own, is refused."""
    from engine.config import needs_old_log_prob_forward

    validate(composed("rollout.log_probs=false"), world_size=1)  # grpo: a KL loss, no TIS
    validate(
        composed("rollout.log_probs=false", "algorithm=dapo", "algorithm.overlong_buffer_len=2"), world_size=1
    )
    for extra in ([], ["algorithm.ppo_epochs=2"], ["algorithm.num_mini_batches=2"]):
        cfg = composed("rollout.log_probs=false", "algorithm=ppo", *extra)
        assert needs_old_log_prob_forward(cfg.algorithm, rollout_log_probs=False)
        validate(cfg, world_size=1)
    one_step = composed("algorithm=ppo").algorithm
    assert not needs_old_log_prob_forward(one_step) and needs_old_log_prob_forward(one_step, False)
    assert not needs_old_log_prob_forward(composed("algorithm=grpo").algorithm, rollout_log_probs=False)
    with pytest.raises(ConfigError, match=r"algorithm.tis_cap=0\.5.*Fix: set rollout.log_probs=true, or "):
        validate(composed("rollout.log_probs=false", "algorithm.tis_cap=0.5"), world_size=1)
