"""Every bad config value is refused before any process starts, with a message naming its key (no
processes, no models)."""

from __future__ import annotations

import pytest
from config_compose import composed

from engine.config import ConfigError
from engine.validate import validate

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
    (
        ["algorithm=dapo", "algorithm.policy_loss=gspo"],
        1,
        "algorithm.policy_loss=gspo clips one ratio per sequence",
    ),
    (["algorithm.kl_estimator=k9"], 1, "algorithm.kl_estimator"),
    (["algorithm.clip_ratio_c=0.5"], 1, "algorithm.clip_ratio_c"),
    (["algorithm.clip_ratio_low=1.5"], 1, "algorithm.clip_ratio_low=1.5: must be < 1"),
    (["trainer.cuda_graphs=true"], 1, "trainer.cuda_graphs=True: captures CUDA graphs: needs cluster.device"),
    (["optim.adam_beta1=1.5"], 1, "optim.adam_beta1=1.5: must lie in [0, 1)"),
    (["optim.adam_beta2=-0.1"], 1, "optim.adam_beta2"),
    (["optim.adam_eps=-1"], 1, "optim.adam_eps"),
    (["optim.weight_decay=-0.1"], 1, "optim.weight_decay"),
    (["trainer.seed=-1"], 1, "trainer.seed=-1: must be >= 0"),
    (
        ["trainer.total_steps=3", "trainer.profile_steps=[0,3,4]"],
        1,
        "trainer.profile_steps=[0, 3, 4]: names steps outside 1..trainer.total_steps=3: [0, 4]",
    ),
    (["rollout.max_num_seqs=0"], 1, "rollout.max_num_seqs"),
    (["model.head_dim=3"], 1, "model.head_dim=3"),
    (["model.vocab_size=-5"], 1, "model.vocab_size"),
    (["model.init_std=-0.02"], 1, "model.init_std"),
    (["model.rope_theta=0"], 1, "model.rope_theta"),
    (["model.norm_eps=-1"], 1, "model.norm_eps"),
    (["model.rope_scaling_factor=-2"], 1, "model.rope_scaling_factor=-2.0: must be >= 0"),
    (["model.hidden_size=66"], 1, "model.hidden_size=66: must be divisible by model.num_attention_heads=4"),
    (["data.embedded_digits=0"], 1, "data.embedded_digits"),
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


@pytest.mark.parametrize("overrides,world,needle", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_config_names_the_key(overrides, world, needle):
    cfg = composed(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=world)
    message = str(err.value)
    assert needle in message
    assert "Fix:" in message or "launch" in message or "use" in message
