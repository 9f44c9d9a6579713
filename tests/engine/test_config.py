"""Config composition and validation: every bad value names its key (no processes, no models)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from engine.config import ConfigError, TrainConfig, register_configs
from engine.config_load import to_dataclass
from engine.validate import validate
from engine.validate.ignored import ignored_key_warnings

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


@pytest.mark.parametrize(
    "algorithm", sorted(name[:-5] for name in os.listdir(os.path.join(CONF, "algorithm")))
)
def test_presets_compose_and_validate(algorithm):
    """Every conf/algorithm preset validates with the default job as is (no other override)."""
    validate(composed(f"algorithm={algorithm}"), world_size=1)


@pytest.mark.parametrize("preset", ["tiny_moe", "qwen3_30b_a3b", "qwen1_5_moe_a2_7b"])
def test_moe_presets_compose_validate_and_resolve(preset):
    """The MoE presets validate at a layout that splits their experts, and resolve to the router that
    their Hugging Face family uses (softmax, renormalised over the top-k for Qwen3-MoE, not for Qwen2-MoE)."""
    from engine.models.builder import resolve_shape

    cfg = composed(f"model={preset}", "data.max_prompt_len=32")
    assert validate(cfg, world_size=2).dp == 2
    assert (
        validate(composed(f"model={preset}", "data.max_prompt_len=32", "parallel.ep=2"), world_size=2).ep == 2
    )
    moe = resolve_shape(cfg.model, 100, 1).moe
    assert moe.num_experts == cfg.model.moe.num_experts > moe.top_k
    assert moe.norm_topk_prob == (preset != "qwen1_5_moe_a2_7b")
    assert (moe.shared_ffn_hidden_size > 0) == moe.shared_gate == (preset == "qwen1_5_moe_a2_7b")
    assert resolve_shape(composed().model, 100, 1).moe is None  # the default model stays dense


def test_expert_parallel_accepts_pipeline_stages_and_a_narrower_rollout_tp():
    """parallel.ep=2 with parallel.pp=2, and with parallel.tp=2 rolled out at rollout.tp=1 (world 4): the
    3D-HybridEngine regroups the experts too (parallel/expert_gather.py)."""
    moe = ("model=tiny_moe", "data.max_prompt_len=32", "parallel.ep=2")
    assert validate(composed(*moe, "parallel.pp=2"), world_size=4).pp == 2
    dims = validate(composed(*moe, "parallel.tp=2", "parallel.sp=true", "rollout.tp=1"), world_size=4)
    assert (dims.tp, dims.ep) == (2, 2)


def test_unknown_key_fails_at_compose():
    with pytest.raises(Exception, match="trainer.totl_steps|totl_steps"):
        composed("trainer.totl_steps=3")


@pytest.mark.parametrize(
    "override,hint",
    [
        ("+trainer.totl_steps=3", "did you mean trainer.total_steps=3?"),
        ("+rollout.max_tokens=16", "did you mean rollout.max_new_tokens=16?"),
        ("+foo=1", "foo=1: not a key"),
    ],
)
def test_appended_unknown_key_is_refused_with_the_closest_key(override, hint):
    """Hydra's `+key=value` (its own fix for an unknown key) appends to the composed config; the schema is
    closed, so the key is refused instead of silently ignored."""
    with pytest.raises(ConfigError, match="not a key of the configuration") as err:
        composed(override)
    assert hint in str(err.value)


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
    (["model.num_layers=3", "parallel.pp=2", "parallel.vpp=3"], 2, "model.num_layers=3"),
    (["model.num_layers=2", "parallel.pp=4"], 4, "model.num_layers=2"),
    (["parallel.first_stage_layers=1"], 1, "parallel.first_stage_layers=1 needs parallel.pp > 1"),
    (
        ["model.num_layers=4", "parallel.pp=2", "parallel.last_stage_layers=4"],
        2,
        "parallel.last_stage_layers=4",
    ),
    (["model.path=/nonexistent/ckpt"], 1, "model.path"),
    (["model.dtype=fp8"], 1, "model.dtype"),
    (["data.max_prompt_len=1000"], 1, "data.max_prompt_len + rollout.max_new_tokens"),
    (["data.bad_rows=ignore"], 1, "data.bad_rows"),
    (["optim.lr=0"], 1, "optim.lr"),
    (["optim.lr_decay=step"], 1, "optim.lr_decay"),
    (["optim.min_lr=1"], 1, "optim.min_lr"),
    (["optim.initial_loss_scale=0"], 1, "optim.initial_loss_scale"),
    (["trainer.loggers=[console,mlflow]"], 1, "trainer.loggers"),
    (["trainer.resume=/no/such/checkpoint"], 1, "trainer.resume"),
    (["cluster.device=tpu"], 1, "cluster.device"),
    (["rollout.log_probs=false", "algorithm.tis_cap=2"], 1, "rollout.log_probs=False: algorithm.tis_cap=2.0"),
    (["reward.timeout_s=-1"], 1, "reward.timeout_s=-1.0: must be >= 0"),
    (["reward.fn=score"], 1, "reward.fn='score': expected 'module:function'"),
    (["reward.fn=/no/such/reward.py:score"], 1, "reward.fn='/no/such/reward.py:score': file"),
    (["reward.fn=engine.rewards.gsm8k:no_such_fn"], 1, "has no function 'no_such_fn'"),
    (["reward.fn=no_such_module_x:score"], 1, "reward.fn='no_such_module_x:score': cannot import module"),
    # placement: rank counts, the rollout side's layout, what split placement does not run with
    (["placement.mode=spread"], 2, "placement.mode='spread': unknown value"),
    (["placement.rollout_ranks=1"], 2, "placement.rollout_ranks=1: needs placement.mode=split"),
    (["trainer.off_policy_steps=1"], 2, "trainer.off_policy_steps=1: needs placement.mode=split"),
    (["trainer.off_policy_steps=2"], 2, "trainer.off_policy_steps=2: must be 0"),
    (["placement.mode=split"], 2, "placement.rollout_ranks=0: placement.mode=split needs at least one"),
    (["placement.mode=split", "placement.rollout_ranks=2"], 2, "leaves 0 of the 2 ranks"),
    (["placement.mode=split", "placement.rollout_ranks=1", "parallel.tp=2"], 4, "leaves 3 training ranks"),
    (
        ["placement.mode=split", "placement.rollout_ranks=3", "rollout.tp=2"],
        4,
        "rollout.tp=2: must divide placement.rollout_ranks=3",
    ),
    (
        ["placement.mode=split", "placement.rollout_ranks=2", "rollout.tp=4"],
        6,
        "rollout.tp=4: must divide placement.rollout_ranks=2",
    ),
    (
        ["placement.mode=split", "placement.rollout_ranks=3", "model.num_query_groups=2", "rollout.tp=3"],
        4,
        "rollout.tp=3: must divide model.num_attention_heads=4",
    ),
    (["placement.mode=split", "placement.rollout_ranks=3", "data.batch_size=16"], 4, "rollout DP size 3"),
    (["placement.mode=split", "placement.rollout_ranks=1", "placement.critic_ranks=1"], 3, "has no critic"),
    (
        ["placement.mode=split", "placement.rollout_ranks=1", "placement.critic_ranks=2", "algorithm=ppo"],
        4,
        "placement.critic_ranks=2: must be critic TP x PP x the actor's DP = 1 x 1 x 1 = 1",
    ),
    (
        ["placement.mode=split", "placement.rollout_ranks=1", "placement.critic_ranks=3", "algorithm=ppo"]
        + ["placement.critic_tp=3", "model.num_query_groups=2"],
        5,
        "placement.critic_tp=3: must divide model.num_attention_heads=4",
    ),
    (
        ["placement.mode=split", "placement.rollout_ranks=1", "placement.critic_ranks=1", "algorithm=ppo"]
        + ["rollout.backend=vllm", "cluster=single_gpu", "trainer.save_freq=0"],
        3,
        "placement.critic_ranks=1: with rollout.backend=vllm is not built",
    ),
    (
        [
            "placement.mode=split",
            "placement.rollout_ranks=1",
            "trainer.test_freq=0",
            "trainer.off_policy_steps=1",
        ],
        3,
        "trainer.off_policy_steps=1: trains on responses of the previous step's weights",
    ),
    (["algorithm.tis_mode=clip"], 1, "algorithm.tis_mode='clip'"),
    # mixture of experts: the router, the experts over parallel.ep
    (["parallel.ep=2"], 2, "parallel.ep=2: expert parallelism needs a mixture-of-experts model"),
    (
        ["model=tiny_moe", "parallel.ep=3"],
        4,
        "parallel.ep=3 must be >= 1 and divide the ranks of one pipeline",
    ),
    (["model=tiny_moe", "parallel.ep=2", "parallel.pp=2"], 2, "parallel.ep=2 must be >= 1 and divide"),
    (
        ["model=tiny_moe", "model.moe.num_experts=6", "parallel.ep=4"],
        4,
        "model.moe.num_experts=6: must be divisible",
    ),
    (["model=tiny_moe", "model.moe.top_k=5"], 1, "model.moe.top_k=5: must be between 1 and"),
    (["model=tiny_moe", "model.moe.top_k=0"], 1, "model.moe.top_k=0: must be between 1 and"),
    (
        ["model=tiny_moe", "model.moe.score_function=relu"],
        1,
        "model.moe.score_function='relu': unknown value",
    ),
    (["model=tiny_moe", "model.moe.token_dispatcher=flex"], 1, "model.moe.token_dispatcher='flex'"),
    # routing replay: an MoE model, the native rollout, single-turn colocated rollouts
    (["algorithm.router_replay=true"], 1, "algorithm.router_replay=True: replays the experts of a mixture"),
    (
        ["model=tiny_moe", "algorithm.router_replay=true", "rollout.multi_turn.enable=true"],
        1,
        "algorithm.router_replay=True: records the routes of single-turn rollouts only",
    ),
    (["model=tiny_moe", "model.moe.aux_loss_coef=-1"], 1, "model.moe.aux_loss_coef=-1.0: must be >= 0"),
    (["model=tiny_moe", "model.moe.shared_expert_gate=true"], 1, "model.moe.shared_expert_gate=True"),
    (
        ["model=tiny_moe", "model.moe.score_function=sigmoid", "model.moe.norm_topk_prob=false"],
        1,
        "model.moe.norm_topk_prob=False: megatron's sigmoid router always renormalises",
    ),
    (["model=tiny_moe", "model.moe.top_k=1"], 1, "model.moe.norm_topk_prob=True: with top_k=1"),
    (
        ["model=tiny_moe", "parallel.tp=2"],
        2,
        "parallel.sp=False: megatron's MoE layers train at parallel.tp=2",
    ),
    (
        ["model=tiny_moe", "parallel.ep=2", "rollout.weight_sync=naive"],
        2,
        "rollout.weight_sync='naive': with parallel.ep > 1",
    ),
]


def test_split_placement_validates_the_training_layout_on_the_training_ranks():
    """placement.mode=split: the returned layout covers the ranks before the rollout ranks; rollout.tp is
    the rollout side's own (it need not divide parallel.tp)."""
    base = ["placement.mode=split", "trainer.test_freq=0"]
    dims = validate(composed(*base, "placement.rollout_ranks=1"), world_size=3)
    assert (dims.world_size, dims.dp) == (2, 2)
    dims = validate(
        composed(*base, "placement.rollout_ranks=2", "parallel.tp=2", "rollout.tp=2"), world_size=4
    )
    assert (dims.world_size, dims.tp, dims.dp) == (2, 2, 1)
    dims = validate(composed(*base, "placement.rollout_ranks=2", "rollout.tp=2"), world_size=3)
    assert (dims.world_size, dims.tp) == (1, 1)
    assert validate(composed(), world_size=4).world_size == 4  # colocated (the default): every rank trains
    off_policy = ["trainer.off_policy_steps=1", "algorithm.tis_cap=2", "algorithm.tis_mode=mask"]
    assert validate(composed(*base, "placement.rollout_ranks=1", *off_policy), world_size=3).dp == 2
    served = ["trainer.test_freq=5", "algorithm.dynamic_sampling=true"]  # the rollout ranks run these too
    assert validate(composed(*base, "placement.rollout_ranks=1", *served), world_size=3).dp == 2


def test_uneven_pipeline_stages_are_accepted():
    """Layer counts that parallel.pp does not divide take megatron's uneven first/last stages."""
    dims = validate(composed("model.num_layers=3", "parallel.pp=2"), world_size=2)
    assert dims.stage_layer_counts(3) == (2, 1)
    cfg = composed("model.num_layers=5", "parallel.pp=2", "parallel.first_stage_layers=1")
    assert validate(cfg, world_size=2).stage_layer_counts(5) == (1, 4)


def test_stage_split_of_a_checkpoint_names_its_config_file(tmp_path):
    """A checkpoint's layer count is checked against the pipeline before any process group exists."""
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 3}')
    cfg = composed("model.num_layers=6", "parallel.pp=2", "parallel.vpp=3", f"critic.path={tmp_path}")
    with pytest.raises(ConfigError, match="Fix:") as err:
        validate(cfg, world_size=2)
    assert f"{tmp_path}/config.json: num_hidden_layers=3" in str(err.value)


@pytest.mark.parametrize("overrides,world,needle", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_config_names_the_key(overrides, world, needle):
    cfg = composed(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=world)
    message = str(err.value)
    assert needle in message
    assert "Fix:" in message or "launch" in message or "use" in message


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
        validate_router_replay(cfg)


def test_reward_fn_is_imported_during_validation():
    stall_reward = os.path.join(os.path.dirname(__file__), "stall_reward.py")
    validate(composed(f"reward.fn={stall_reward}:score"), world_size=1)
    validate(composed("reward.fn=engine.rewards.registry:rule_reward"), world_size=1)


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
    from engine.validate.rollout import validate_rollout
    from parallel.dims import ParallelDims

    cfg = composed("rollout.backend=vllm", "rollout.tp=2", "parallel.tp=4")
    cfg.cluster.device = "cuda"  # checked on its own before this rule; pretend a GPU is visible
    with pytest.raises(ConfigError, match="rollout.tp=2"):
        validate_rollout(cfg, ParallelDims(world_size=4, tp=4))
    cfg.rollout.tp = 4
    validate_rollout(cfg, ParallelDims(world_size=4, tp=4))


def test_vllm_on_split_placement_lines_up_with_vllms_tp_groups():
    """Split placement runs rollout.backend=vllm on the rollout ranks; vLLM cuts the whole job into TP groups of
    consecutive ranks, so the training ranks before the rollout ranks must fill whole groups."""
    from engine.validate.placement import validate_placement
    from parallel.dims import ParallelDims

    cfg = composed(
        "placement.mode=split", "placement.rollout_ranks=2", "rollout.backend=vllm", "rollout.tp=2"
    )
    validate_placement(cfg, ParallelDims(world_size=2, tp=1))  # ranks 0-1 train, 2-3: one vLLM TP group
    with pytest.raises(
        ConfigError, match="rollout.tp=2: with rollout.backend=vllm must divide the 1 training"
    ):
        validate_placement(cfg, ParallelDims(world_size=1, tp=1))  # vLLM's groups would be [0, 1], [2]


def test_vllm_log_probs_with_truncation_need_temperature_one():
    """vLLM's log-probs are raw (before temperature) or processed (after top-p/top-k truncation): with top-p or
    top-k at T != 1 neither is the full distribution at T, so rollout.log_probs must be off there."""
    from engine.validate.rollout import validate_rollout
    from parallel.dims import ParallelDims

    dims = ParallelDims(world_size=1, tp=1)
    for overrides in (["rollout.top_p=0.9"], ["rollout.top_k=20"], ["rollout.temperature=0.7"]):
        cfg = composed("rollout.backend=vllm", *overrides)
        cfg.cluster.device = "cuda"  # checked on its own before this rule; pretend a GPU is visible
        validate_rollout(cfg, dims)
    cfg = composed("rollout.backend=vllm", "rollout.top_p=0.9", "rollout.temperature=0.7")
    cfg.cluster.device = "cuda"
    with pytest.raises(
        ConfigError, match=r"rollout.temperature=0.7.*rollout.top_p=0.9.*Fix: set rollout.temp"
    ):
        validate_rollout(cfg, dims)
    cfg.rollout.log_probs = False
    validate_rollout(cfg, dims)
    cfg.rollout.backend, cfg.rollout.log_probs = "native", True  # the native sampler gives them at any T
    validate_rollout(cfg, dims)


@pytest.mark.parametrize(
    "preset", ["grpo", "dr_grpo", "dapo", "gspo", "ppo", "reinforce_pp", "remax", "rloo"]
)
def test_presets_set_no_ignored_keys(preset):
    assert ignored_key_warnings(composed(f"algorithm={preset}")) == []


def test_keys_a_combination_ignores_get_one_warning_each():
    """A key counts as set when it differs from the schema default; one line per ignored key, naming it, its
    value and why."""
    cfg = composed(
        "algorithm=rloo",
        "critic.lr=1e-5",
        "critic.path=/ckpt",
        "algorithm.norm_adv_by_std=false",
        "algorithm.lam=0.9",
    )
    lines = ignored_key_warnings(cfg)
    assert lines == [
        "warning: critic.path='/ckpt' is ignored: only algorithm.adv_estimator=gae (PPO) has a critic",
        "warning: critic.lr=1e-05 is ignored: only algorithm.adv_estimator=gae (PPO) has a critic",
        "warning: algorithm.lam=0.9 is ignored: GAE's lambda: only algorithm.adv_estimator=gae reads it",
        "warning: algorithm.norm_adv_by_std=False is ignored: only algorithm.adv_estimator=grpo divides by the "
        "group std",
    ]
    # the same keys where the combination reads them: no warning
    assert ignored_key_warnings(composed("algorithm=ppo", "critic.lr=1e-5", "algorithm.lam=0.9")) == []
    assert ignored_key_warnings(composed("algorithm=grpo", "algorithm.norm_adv_by_std=false")) == []
    split = composed("placement.mode=split", "placement.rollout_ranks=1", "rollout.weight_sync=naive")
    assert ignored_key_warnings(split) == [
        "warning: rollout.weight_sync='naive' is ignored: placement.mode=split: the rollout ranks keep their own "
        "weights, sent by parallel/split_transfer.py"
    ]
    assert ignored_key_warnings(composed("optim.min_lr=1e-5")) == [
        "warning: optim.min_lr=1e-05 is ignored: optim.lr_decay=constant never decays to it"
    ]


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


def test_interleaved_pipeline_needs_a_multiple_of_pp_micro_batches_per_update():
    """parallel.vpp > 1: megatron's interleaved schedule takes a positive multiple of pp micro-batches per
    call; the update's count (sequences per mini-batch / trainer.micro_batch_size) is checked up front."""
    two = ("parallel.pp=2", "parallel.vpp=2", "model.num_layers=4")  # 16 prompts x 8 = 128 sequences
    validate(composed(*two, "trainer.micro_batch_size=32"), world_size=2)  # 4 micro-batches
    with pytest.raises(
        ConfigError, match=r"trainer.micro_batch_size=128: gives 1 micro-batches.*parallel.pp=2"
    ):
        validate(composed(*two, "trainer.micro_batch_size=128"), world_size=2)
    four = ("parallel.pp=4", "parallel.vpp=2", "model.num_layers=8")
    with pytest.raises(ConfigError, match=r"Fix: use trainer.micro_batch_size in \[1, 2, 4, 8, 16, 32\]"):
        validate(composed(*four, "trainer.micro_batch_size=64"), world_size=4)
    with pytest.raises(ConfigError, match="make the sequences per mini-batch a multiple of 4"):
        validate(
            composed(*four, "data.batch_size=2", "rollout.n=3", "trainer.micro_batch_size=1"), world_size=4
        )
    # a token budget varies the count at run time: refused with vpp > 1
    with pytest.raises(ConfigError, match="trainer.max_tokens_per_micro_batch=.*interleaved"):
        validate(composed(*two, "trainer.max_tokens_per_micro_batch=4096"), world_size=2)


def test_pack_sequences_defaults_on_with_a_token_budget_and_needs_one():
    from engine.config import packs_sequences

    assert not packs_sequences(composed().trainer)
    assert packs_sequences(composed("trainer.max_tokens_per_micro_batch=4096").trainer)
    padded = composed("trainer.max_tokens_per_micro_batch=4096", "trainer.pack_sequences=false")
    validate(padded, world_size=1)
    assert not packs_sequences(padded.trainer)
    with pytest.raises(
        ConfigError, match=r"trainer.pack_sequences=True: .*trainer.max_tokens_per_micro_batch=0\. Fix: set"
    ):
        validate(composed("trainer.pack_sequences=true"), world_size=1)


def test_checkpoint_positions_must_hold_prompt_plus_response(tmp_path):
    """With model.path (and critic.path under GAE, reward.model_path) the checkpoint's config.json gives
    max_position_embeddings; data.max_prompt_len + rollout.max_new_tokens (64 + 5 by default) must fit.
    A missing, unreadable or incomplete config.json is an error naming the file."""
    import json
    import re

    def checkpoint(name: str, text: str | None = None, **config) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config) if text is None else text)
        (path / "tokenizer_config.json").write_text("{}")  # model.path's tokenizer must exist too
        return str(path)

    def refused(overrides: list[str], message: str) -> None:
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(composed(*overrides), world_size=1)

    short = checkpoint("short", max_position_embeddings=64)
    long = checkpoint("long", max_position_embeddings=128)
    validate(composed(f"model.path={long}"), world_size=1)
    validate(composed(f"model.path={short}", "data.max_prompt_len=59"), world_size=1)  # exactly 64
    rule = "data.max_prompt_len + rollout.max_new_tokens=69: must be <= max_position_embeddings=64 of "
    refused([f"model.path={short}"], f"{rule}model.path='{short}' ({short}/config.json). Fix: lower")
    refused([f"model.path={long}", "algorithm=ppo", f"critic.path={short}"], f"{rule}critic.path='{short}'")
    reward = checkpoint(
        "reward", max_position_embeddings=64, architectures=["Qwen2ForSequenceClassification"]
    )
    refused([f"reward.model_path={reward}"], f"{rule}reward.model_path='{reward}'")

    (tmp_path / "empty").mkdir()
    empty = str(tmp_path / "empty")
    refused(
        [f"model.path={empty}"], f"model.path='{empty}': has no config.json ({empty}/config.json is missing)"
    )
    broken = checkpoint("broken", text="{not json")
    refused([f"model.path={broken}"], f"{broken}/config.json is not a readable JSON config (JSONDecodeError")
    keyless = checkpoint("keyless", hidden_size=8)
    refused([f"model.path={keyless}"], f"{keyless}/config.json has no max_position_embeddings")


def test_data_files_take_one_path_or_a_list_and_expand_home(monkeypatch, tmp_path):
    """verl's `data.train_files=~/data/train.parquet` (one path) and lists; `~` expands (the command line's
    unquoted `~` is expanded by engine.train: tests/engine/test_user_errors.py)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    one = composed('data.train_files="~/data/train.parquet"', "data.val_files=/data/test.parquet").data
    assert one.train_files == [f"{tmp_path}/data/train.parquet"] and one.val_files == ["/data/test.parquet"]
    many = composed('data.train_files=["~/a.parquet",/b.parquet]').data
    assert many.train_files == [f"{tmp_path}/a.parquet", "/b.parquet"] and many.val_files == []
    with pytest.raises(ConfigError, match=r"data.train_files=3: must be a path or a list of paths. Fix:"):
        composed("data.train_files=3")


def test_a_newly_registered_estimator_is_validated_by_its_traits():
    """Validation takes the names and capabilities from the registry: a new estimator is accepted, and what it
    declares (group-relative, reads gamma) decides the rules and the ignored-key warnings."""
    from algorithms.advantages import (
        AdvantageTraits,
        advantage_estimator_names,
        get_advantage_estimator,
        register_advantage,
    )

    name = "test_group_gamma"
    if name not in advantage_estimator_names():
        traits = AdvantageTraits(group_relative=True, uses_gamma=True)
        register_advantage(name, traits)(get_advantage_estimator("grpo"))
    validate(composed(f"algorithm.adv_estimator={name}"), world_size=1)
    with pytest.raises(ConfigError, match=f"rollout.n=1: algorithm.adv_estimator={name} compares responses"):
        validate(composed(f"algorithm.adv_estimator={name}", "rollout.n=1"), world_size=1)
    warnings = ignored_key_warnings(composed(f"algorithm.adv_estimator={name}", "algorithm.gamma=0.9"))
    assert not any("algorithm.gamma" in line for line in warnings)
