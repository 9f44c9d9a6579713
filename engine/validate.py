"""Checks on the composed configuration, run before any process group or model exists.

Each check raises `ConfigError` naming the key(s), the value, the rule and a fix. The order follows the
config groups so that the first message a user sees is about the first thing they would look at.
"""

from __future__ import annotations

import json
import os

from algorithms.advantages import advantage_estimator_names, advantage_traits
from algorithms.kl import KL_CONTROLLERS, KL_CONTROLLERS_WITH_TARGET, kl_estimator_names
from algorithms.losses import LOSS_AGG_MODES, policy_loss_names, policy_loss_traits
from engine.config import DTYPES, LOGGERS, ConfigError, TrainConfig
from parallel.dims import ParallelDims


def _fail(key: str, value: object, rule: str, fix: str) -> None:
    raise ConfigError(f"{key}={value!r}: {rule}. Fix: {fix}")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _fail(key, value, f"unknown value; known: {', '.join(allowed)}", f"set {key} to one of them")


def _positive(key: str, value: float) -> None:
    if value <= 0:
        _fail(key, value, "must be > 0", f"set {key} to a positive value")


def validate(cfg: TrainConfig, world_size: int) -> ParallelDims:
    """Check every group and cross-group rule; return the validated training layout."""
    dims = _validate_parallel(cfg, world_size)
    _validate_model(cfg, dims)
    _validate_algorithm(cfg)
    _validate_rollout(cfg, dims)
    _validate_batches(cfg, dims)
    _validate_optim(cfg)
    _validate_trainer(cfg)
    _validate_reward(cfg)
    _validate_optional_packages(cfg)
    return dims


def _validate_parallel(cfg: TrainConfig, world_size: int) -> ParallelDims:
    if cfg.cluster.device not in ("cpu", "cuda"):
        _fail(
            "cluster.device",
            cfg.cluster.device,
            "must be cpu or cuda",
            "pick cluster=cpu or cluster=single_gpu",
        )
    _positive("cluster.timeout_s", cfg.cluster.timeout_s)
    if cfg.cluster.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            _fail("cluster.device", "cuda", "no CUDA device is visible", "use cluster=cpu on this machine")
    try:
        return ParallelDims(
            world_size=world_size,
            tp=cfg.parallel.tp,
            pp=cfg.parallel.pp,
            vpp=cfg.parallel.vpp,
            sp=cfg.parallel.sp,
            first_stage_layers=cfg.parallel.first_stage_layers,
            last_stage_layers=cfg.parallel.last_stage_layers,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _validate_stage_layers(cfg: TrainConfig, dims: ParallelDims) -> None:
    """Every model's layers split over the pipeline stages (megatron's uneven first/last stages): the
    actor's (model.num_layers, or model.path's config.json), the critic's and the reward model's."""
    counts = [] if cfg.model.path else [("model.num_layers", cfg.model.num_layers)]
    for path in (cfg.model.path, cfg.critic.path, cfg.reward.model_path):
        config_file = os.path.join(path, "config.json")
        if path and os.path.isfile(config_file):
            try:
                with open(config_file) as f:
                    num_layers = json.load(f).get("num_hidden_layers")  # absent: named when it is read
            except (OSError, ValueError, AttributeError):  # unreadable: named by the positions check
                continue
            if isinstance(num_layers, int) and num_layers > 0:
                counts.append((f"{config_file}: num_hidden_layers", num_layers))
    for key, num_layers in counts:
        try:
            dims.stage_layer_counts(num_layers)
        except ValueError as err:
            raise ConfigError(f"{key}={num_layers}: {err}") from None


def _validate_model(cfg: TrainConfig, dims: ParallelDims) -> None:
    m = cfg.model
    if m.path and not os.path.isdir(m.path):
        _fail(
            "model.path",
            m.path,
            "is not a directory",
            "point model.path at a local Hugging Face checkpoint directory",
        )
    _one_of("model.dtype", m.dtype, DTYPES)
    for key, value in (
        ("model.num_layers", m.num_layers),
        ("model.hidden_size", m.hidden_size),
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.num_query_groups", m.num_query_groups),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
    ):
        _positive(key, value)
    if m.path:
        _validate_checkpoint_positions(cfg, "model.path", m.path)  # config.json readable first
    _validate_stage_layers(cfg, dims)
    if m.path:
        _validate_tokenizer_source(cfg)
        return  # the rest of the architecture comes from config.json; checked when it is read
    if m.head_dim == 0 and m.hidden_size % m.num_attention_heads:
        _fail(
            "model.hidden_size",
            m.hidden_size,
            f"must be divisible by model.num_attention_heads={m.num_attention_heads}",
            "set model.head_dim explicitly or change the sizes",
        )
    if m.num_attention_heads % m.num_query_groups:
        _fail(
            "model.num_query_groups",
            m.num_query_groups,
            f"must divide model.num_attention_heads={m.num_attention_heads}",
            "use a divisor of the head count",
        )
    for key, value in (
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.num_query_groups", m.num_query_groups),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
    ):
        if value % dims.tp:
            _fail(
                key,
                value,
                f"must be divisible by parallel.tp={dims.tp}",
                "lower parallel.tp or change the model",
            )
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if longest > m.max_position_embeddings:
        _fail(
            "data.max_prompt_len + rollout.max_new_tokens",
            longest,
            f"must be <= model.max_position_embeddings={m.max_position_embeddings}",
            "shorten prompts/responses or raise model.max_position_embeddings",
        )


def _validate_tokenizer_source(cfg: TrainConfig) -> None:
    """An empty model.tokenizer_path means model.path's tokenizer (the embedded task included): refuse a
    model.path without one rather than tokenise with something else."""
    from engine.data import TOKENIZER_FILES

    m = cfg.model
    if m.tokenizer_path or not m.path or not os.path.isdir(m.path):
        return
    if not any(os.path.isfile(os.path.join(m.path, name)) for name in TOKENIZER_FILES):
        _fail(
            "model.path",
            m.path,
            f"model.tokenizer_path is empty, so the tokenizer is model.path's, but {m.path} has no tokenizer "
            f"files (looked for {', '.join(TOKENIZER_FILES)})",
            f"save the model's tokenizer into {m.path} (tokenizer.save_pretrained), or set "
            "model.tokenizer_path to a directory that has one",
        )


def _validate_checkpoint_positions(cfg: TrainConfig, key: str, path: str) -> None:
    """The checkpoint directory `path` (set by `key`) holds the longest sequence: its config.json's
    max_position_embeddings >= data.max_prompt_len + rollout.max_new_tokens. Reads the JSON file only."""
    file = os.path.join(path, "config.json")
    fix = f"point {key} at a checkpoint saved with save_pretrained (it writes config.json)"
    if not os.path.isfile(file):
        _fail(key, path, f"has no config.json ({file} is missing)", fix)
    try:
        with open(file) as f:
            limit = int(json.load(f)["max_position_embeddings"])
    except KeyError:
        _fail(key, path, f"{file} has no max_position_embeddings", fix)
    except (OSError, ValueError, TypeError) as err:
        _fail(key, path, f"{file} is not a readable JSON config ({type(err).__name__}: {err})", fix)
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if longest > limit:
        _fail(
            "data.max_prompt_len + rollout.max_new_tokens",
            longest,
            f"must be <= max_position_embeddings={limit} of {key}={path!r} ({file})",
            "lower data.max_prompt_len or rollout.max_new_tokens to fit the model's positions",
        )


def _validate_algorithm(cfg: TrainConfig) -> None:
    a = cfg.algorithm
    _one_of("algorithm.adv_estimator", a.adv_estimator, tuple(advantage_estimator_names()))
    _one_of("algorithm.policy_loss", a.policy_loss, tuple(policy_loss_names()))
    _one_of("algorithm.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES)
    _one_of("algorithm.kl_estimator", a.kl_estimator, tuple(kl_estimator_names()))
    _one_of("algorithm.kl_ctrl", a.kl_ctrl, KL_CONTROLLERS)
    for key, value in (
        ("algorithm.clip_ratio_low", a.clip_ratio_low),
        ("algorithm.clip_ratio_high", a.clip_ratio_high),
    ):
        _positive(key, value)
    if a.clip_ratio_c <= 1.0:
        _fail(
            "algorithm.clip_ratio_c",
            a.clip_ratio_c,
            "dual-clip bound must be > 1",
            "use 3.0 (the usual value)",
        )
    if not 0.0 <= a.gamma <= 1.0 or not 0.0 <= a.lam <= 1.0:
        _fail(
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
            _fail(key, value, "must be >= 0", f"set {key}=0 to turn it off")
    _positive("algorithm.ppo_epochs", a.ppo_epochs)
    _positive("algorithm.num_mini_batches", a.num_mini_batches)
    _positive("algorithm.max_sampling_rounds", a.max_sampling_rounds)
    _validate_kl_in_reward(cfg)
    if a.value_clip < 0:
        _fail("algorithm.value_clip", a.value_clip, "must be >= 0", "use 0.2, or 0 to turn clipping off")
    if a.overlong_buffer_len < 0 or a.overlong_buffer_len > cfg.rollout.max_new_tokens:
        _fail(
            "algorithm.overlong_buffer_len",
            a.overlong_buffer_len,
            f"the overlong penalty ramps over the last overlong_buffer_len of rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} tokens, so it must lie in [0, rollout.max_new_tokens]",
            f"set algorithm.overlong_buffer_len<={cfg.rollout.max_new_tokens} (e.g. a quarter of "
            "rollout.max_new_tokens), use algorithm.overlong_buffer_frac (a fraction of it) with "
            "overlong_buffer_len=0, raise rollout.max_new_tokens, or use 0 to turn overlong shaping off",
        )
    if not 0.0 <= a.overlong_buffer_frac <= 1.0:
        _fail(
            "algorithm.overlong_buffer_frac",
            a.overlong_buffer_frac,
            "is a fraction of rollout.max_new_tokens, so it must lie in [0, 1]",
            "use 0.2 (DAPO's 4096 of 20480 tokens), or 0 to turn overlong shaping off",
        )
    if a.overlong_penalty < 0:
        _fail("algorithm.overlong_penalty", a.overlong_penalty, "must be >= 0", "use 1.0 (DAPO)")
    if cfg.critic.lr <= 0 or cfg.critic.lr_warmup_steps < 0:
        _fail(
            "critic.lr/critic.lr_warmup_steps",
            (cfg.critic.lr, cfg.critic.lr_warmup_steps),
            "the critic's lr must be > 0 and its warm-up >= 0",
            "use e.g. critic.lr=1e-5 critic.lr_warmup_steps=0",
        )
    if cfg.critic.path and not os.path.isdir(cfg.critic.path):
        _fail(
            "critic.path",
            cfg.critic.path,
            "is not a directory",
            "point critic.path at a local Hugging Face checkpoint directory, or leave it empty for model.path",
        )
    if cfg.critic.path and advantage_traits(a.adv_estimator).needs_critic:  # else no critic is built
        _validate_checkpoint_positions(cfg, "critic.path", cfg.critic.path)


def _validate_kl_in_reward(cfg: TrainConfig) -> None:
    a = cfg.algorithm
    if not a.kl_in_reward:
        if a.kl_reward_coef > 0:
            _fail(
                "algorithm.kl_reward_coef",
                a.kl_reward_coef,
                "has no effect while algorithm.kl_in_reward=false",
                "set algorithm.kl_in_reward=true, or algorithm.kl_reward_coef=0",
            )
        return
    if a.kl_reward_coef <= 0:
        _fail(
            "algorithm.kl_reward_coef",
            a.kl_reward_coef,
            "algorithm.kl_in_reward=true needs a positive starting coefficient (the adaptive controller "
            "only multiplies it)",
            "set algorithm.kl_reward_coef=0.001, or algorithm.kl_in_reward=false",
        )
    if a.kl_ctrl in KL_CONTROLLERS_WITH_TARGET and (a.kl_target <= 0 or a.kl_horizon <= 0):
        _fail(
            "algorithm.kl_target/algorithm.kl_horizon",
            (a.kl_target, a.kl_horizon),
            "the adaptive KL controller needs both > 0",
            "use algorithm.kl_target=0.1 algorithm.kl_horizon=10000",
        )


def _validate_rollout(cfg: TrainConfig, dims: ParallelDims) -> None:
    r = cfg.rollout
    _one_of("rollout.backend", r.backend, ("native", "vllm"))
    _one_of("rollout.weight_sync", r.weight_sync, ("hybrid", "naive"))
    if r.weight_sync == "naive" and r.tp != 1:
        _fail(
            "rollout.weight_sync",
            "naive",
            "the naive baseline gathers full weights: rollout at TP=1 only",
            "use rollout.weight_sync=hybrid for rollout.tp > 1",
        )
    if r.backend == "vllm" and cfg.cluster.device != "cuda":
        _fail(
            "rollout.backend", "vllm", "vLLM needs cluster.device=cuda", "use rollout.backend=native on CPU"
        )
    if r.backend == "vllm" and r.tp not in (1, dims.tp):
        _fail(
            "rollout.tp",
            r.tp,
            f"rollout.backend=vllm groups consecutive ranks into its TP groups, which matches the "
            f"3D-HybridEngine's rollout groups only for rollout.tp = 1 or parallel.tp = {dims.tp}",
            f"use rollout.tp=1 or rollout.tp={dims.tp}, or rollout.backend=native",
        )
    if r.tp < 1 or dims.tp % r.tp:
        divisors = [d for d in range(1, dims.tp + 1) if dims.tp % d == 0]
        _fail("rollout.tp", r.tp, f"must divide parallel.tp={dims.tp}", f"use rollout.tp in {divisors}")
    if r.n < 1:
        _fail("rollout.n", r.n, "must be >= 1", "sample at least one response per prompt")
    if advantage_traits(cfg.algorithm.adv_estimator).group_relative and r.n < 2:
        _fail(
            "rollout.n",
            r.n,
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares responses within a "
            "group, so it needs at least 2 per prompt",
            "set rollout.n=8 (or >= 2)",
        )
    _positive("rollout.temperature", r.temperature)
    if not 0.0 < r.top_p <= 1.0:
        _fail("rollout.top_p", r.top_p, "must lie in (0, 1]", "use 1.0 to turn nucleus sampling off")
    if r.top_k < 0:
        _fail("rollout.top_k", r.top_k, "must be >= 0", "use 0 to turn top-k off")
    _positive("rollout.max_new_tokens", r.max_new_tokens)
    _positive("rollout.val_n", r.val_n)
    if r.val_temperature < 0:
        _fail("rollout.val_temperature", r.val_temperature, "must be >= 0", "use 0 for greedy validation")
    if not 0.0 < r.kv_cache_memory_fraction < 1.0:
        _fail("rollout.kv_cache_memory_fraction", r.kv_cache_memory_fraction, "must lie in (0, 1)", "use 0.5")
    if not 0.0 < r.gpu_memory_utilization < 1.0:
        _fail("rollout.gpu_memory_utilization", r.gpu_memory_utilization, "must lie in (0, 1)", "use 0.5")
    if not r.log_probs:
        _validate_without_rollout_log_probs(cfg)
    if r.backend == "vllm" and r.log_probs:
        _validate_vllm_log_probs(cfg)


def _validate_vllm_log_probs(cfg: TrainConfig) -> None:
    """vLLM's log-probs are taken before temperature or after top-p/top-k truncation
    (engine/rollout/vllm_backend.py): refuse the sampling settings where neither is the full distribution at the
    temperature, which the training forward computes."""
    from engine.rollout.vllm_backend import full_log_probs_mode

    r = cfg.rollout
    if full_log_probs_mode(r.temperature, r.top_p, r.top_k) is None:
        _fail(
            "rollout.temperature",
            r.temperature,
            f"with rollout.backend=vllm and rollout.top_p={r.top_p}, rollout.top_k={r.top_k}, vLLM returns "
            "log-probs either before temperature or over the top-p/top-k truncated distribution, never the "
            "full distribution at the temperature that the training forward computes",
            "set rollout.temperature=1.0, or rollout.top_p=1.0 and rollout.top_k=0, or rollout.log_probs=false "
            "(not with algorithm.tis_cap > 0), or rollout.backend=native",
        )


def _validate_without_rollout_log_probs(cfg: TrainConfig) -> None:
    """rollout.log_probs=false: refuse the settings that need the rollout's own log-probs (a KL in the reward
    takes the old-log-prob forward's instead: engine/config.py `needs_old_log_prob_forward`)."""
    a = cfg.algorithm
    if a.tis_cap > 0:
        _fail(
            "rollout.log_probs",
            False,
            f"algorithm.tis_cap={a.tis_cap} (truncated importance sampling) weights the loss by the ratio of "
            "training to rollout log-probs, so it needs the rollout's log-probs",
            "set rollout.log_probs=true, or algorithm.tis_cap=0",
        )


def _validate_batches(cfg: TrainConfig, dims: ParallelDims) -> None:
    b, mbs = cfg.data.batch_size, cfg.trainer.micro_batch_size
    _positive("data.batch_size", b)
    _positive("trainer.micro_batch_size", mbs)
    _positive("data.max_prompt_len", cfg.data.max_prompt_len)
    _one_of("data.bad_rows", cfg.data.bad_rows, ("error", "skip"))
    _one_of("data.embedded_task", cfg.data.embedded_task, ("copy", "target"))
    if b % dims.dp:
        _fail(
            "data.batch_size",
            b,
            f"must be divisible by the data-parallel size {dims.dp} (= world / (tp*pp))",
            f"use a multiple of {dims.dp}",
        )
    prompts_per_rank = b // dims.dp
    mini = cfg.algorithm.num_mini_batches
    if prompts_per_rank % mini:
        _fail(
            "algorithm.num_mini_batches",
            mini,
            f"must divide the prompts per DP rank (data.batch_size / dp = {prompts_per_rank})",
            "keep whole groups in each mini-batch: pick a divisor",
        )
    seqs_per_mini = prompts_per_rank // mini * cfg.rollout.n
    budget = cfg.trainer.max_tokens_per_micro_batch
    if budget:
        _validate_token_budget(cfg, dims)
        return  # micro_batch_size is not used
    if seqs_per_mini % mbs:
        _fail(
            "trainer.micro_batch_size",
            mbs,
            f"must divide the sequences per mini-batch per DP rank (batch_size/dp/num_mini_batches*rollout.n = {seqs_per_mini})",
            f"use a divisor of {seqs_per_mini}",
        )
    _validate_interleaved_schedule(cfg, dims, seqs_per_mini)


def _validate_interleaved_schedule(cfg: TrainConfig, dims: ParallelDims, seqs_per_mini: int) -> None:
    """parallel.vpp > 1: megatron's interleaved schedule (in groups of pp micro-batches, its default) needs a
    count of micro-batches per call that is a positive multiple of parallel.pp. The update's count is fixed
    by the config; forward-only calls (old/ref log-probs, values, reward model, validation, ReMax greedy)
    take any row count: engine/step/update.py `forward_rows` pads their micro-batch count at run time."""
    if dims.vpp == 1:
        return
    mbs, pp = cfg.trainer.micro_batch_size, dims.pp
    count = seqs_per_mini // mbs
    if count % pp == 0:
        return
    fits = [
        d for d in range(1, seqs_per_mini + 1) if seqs_per_mini % d == 0 and (seqs_per_mini // d) % pp == 0
    ]
    fix = (
        f"use trainer.micro_batch_size in {fits}"
        if fits
        else f"make the sequences per mini-batch a multiple of {pp} (raise data.batch_size or rollout.n, or "
        "lower algorithm.num_mini_batches)"
    )
    _fail(
        "trainer.micro_batch_size",
        mbs,
        f"gives {count} micro-batches per update (sequences per mini-batch per DP rank: batch_size/dp/"
        f"num_mini_batches*rollout.n = {seqs_per_mini}), but the interleaved pipeline schedule "
        f"(parallel.vpp={dims.vpp}) needs a positive multiple of parallel.pp={pp}",
        f"{fix}, or set parallel.vpp=1",
    )


def _validate_token_budget(cfg: TrainConfig, dims: ParallelDims) -> None:
    budget = cfg.trainer.max_tokens_per_micro_batch
    if budget < 0:
        _fail("trainer.max_tokens_per_micro_batch", budget, "must be >= 0", "use 0 to turn it off")
    multiple = dims.seq_multiple
    # +1: the target slot of the last token (as engine/step/batch.py lays sequences out)
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens + 1
    longest = -(-longest // multiple) * multiple
    if budget < longest:
        _fail(
            "trainer.max_tokens_per_micro_batch",
            budget,
            f"must fit the longest sequence, data.max_prompt_len + rollout.max_new_tokens + 1 = {longest} tokens",
            f"set it to at least {longest} (a few times more packs several rows per micro-batch)",
        )
    if dims.vpp > 1:
        _fail(
            "trainer.max_tokens_per_micro_batch",
            budget,
            f"token-budget micro-batches vary in number and shape, which the interleaved pipeline schedule "
            f"(parallel.vpp={dims.vpp}) does not support",
            "set parallel.vpp=1, or trainer.max_tokens_per_micro_batch=0",
        )


def _validate_optim(cfg: TrainConfig) -> None:
    o = cfg.optim
    _positive("optim.lr", o.lr)
    if o.min_lr < 0 or o.min_lr > o.lr:
        _fail("optim.min_lr", o.min_lr, f"must lie in [0, optim.lr={o.lr}]", "lower optim.min_lr")
    _one_of("optim.lr_decay", o.lr_decay, ("constant", "linear", "cosine"))
    if o.clip_grad < 0:
        _fail("optim.clip_grad", o.clip_grad, "must be >= 0", "use 1.0, or 0 to turn clipping off")
    if o.lr_warmup_steps < 0:
        _fail("optim.lr_warmup_steps", o.lr_warmup_steps, "must be >= 0", "use 0 for no warm-up")
    _positive("optim.initial_loss_scale", o.initial_loss_scale)
    _positive("cluster.peak_tflops", cfg.cluster.peak_tflops)


def _validate_trainer(cfg: TrainConfig) -> None:
    t = cfg.trainer
    _positive("trainer.total_steps", t.total_steps)
    for name in t.loggers:
        _one_of("trainer.loggers", name, LOGGERS)
    for key, value in (
        ("trainer.save_freq", t.save_freq),
        ("trainer.test_freq", t.test_freq),
        ("trainer.max_checkpoints", t.max_checkpoints),
    ):
        if value < 0:
            _fail(key, value, "must be >= 0", "use 0 to turn it off")
    if t.resume == "auto" and not t.output_dir:
        _fail(
            "trainer.resume",
            "auto",
            "looks for checkpoints in trainer.output_dir, which is empty (Hydra's run dir is new every run)",
            "set trainer.output_dir to the run's directory",
        )
    if t.resume not in ("auto", "off") and not os.path.isdir(t.resume):
        _fail(
            "trainer.resume",
            t.resume,
            "is neither auto, off nor an existing checkpoint directory",
            "use trainer.resume=auto to continue from the latest checkpoint in trainer.output_dir",
        )
    if t.overwrite and t.resume not in ("auto", "off"):
        _fail(
            "trainer.overwrite",
            True,
            f"has no effect with trainer.resume={t.resume} (a resumed run keeps the directory's outputs)",
            "drop trainer.overwrite, or use trainer.resume=off to start fresh",
        )


def _validate_reward(cfg: TrainConfig) -> None:
    from engine.rewards.gsm8k import METHODS as GSM8K_METHODS
    from engine.roles.reward_model import check_reward_model_dir

    r = cfg.reward
    _one_of("reward.combine", r.combine, ("model", "sum"))
    _one_of("reward.gsm8k_method", r.gsm8k_method, GSM8K_METHODS)
    if r.model_path and r.combine == "model" and r.fn:
        _fail(
            "reward.fn",
            r.fn,
            "would be ignored: reward.combine=model scores with the reward model alone",
            "set reward.combine=sum to add it to the model's score, or reward.fn=''",
        )
    _validate_reward_fn(cfg)
    if not r.model_path:
        return
    if os.path.isdir(r.model_path):
        _validate_checkpoint_positions(cfg, "reward.model_path", r.model_path)
    why = check_reward_model_dir(r.model_path)
    if why:
        _fail(
            "reward.model_path",
            r.model_path,
            why,
            "point it at a local HF reward model saved with save_pretrained (num_labels=1)",
        )


def _ignored_key_rules(cfg: TrainConfig) -> list[tuple[str, bool, str]]:
    """(key, whether this combination of settings ignores it, why) for the keys that only some runs read."""
    a, r, d, t = cfg.algorithm, cfg.rollout, cfg.data, cfg.trainer
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
        ("algorithm.overlong_penalty", a.overlong_buffer_len == 0, "algorithm.overlong_buffer_len=0 (off)"),
        ("algorithm.max_sampling_rounds", not a.dynamic_sampling, "algorithm.dynamic_sampling=false"),
        ("optim.min_lr", cfg.optim.lr_decay == "constant", "optim.lr_decay=constant never decays to it"),
        ("rollout.keep_rollout_weights", r.weight_sync == "naive", "rollout.weight_sync=naive gathers anew"),
        ("rollout.gpu_memory_utilization", r.backend != "vllm", "only rollout.backend=vllm reads it"),
        (
            "rollout.kv_cache_memory_fraction",
            r.backend != "native" or cfg.cluster.device != "cuda",
            "only rollout.backend=native on cluster.device=cuda reads it",
        ),
        ("rollout.val_temperature", t.test_freq == 0, "trainer.test_freq=0: no validation"),
        ("trainer.max_checkpoints", t.save_freq == 0, "trainer.save_freq=0: no checkpoints"),
        ("data.embedded_task", bool(d.train_files), "data.train_files is set"),
        ("data.embedded_digits", bool(d.train_files), "data.train_files is set"),
        ("reward.combine", not cfg.reward.model_path, "no reward.model_path"),
        ("cluster.peak_tflops", cfg.cluster.device == "cpu", "no MFU is computed on CPU"),
    ]


def ignored_key_warnings(cfg: TrainConfig) -> list[str]:
    """One warning line per key set to a value other than the schema's default that this run ignores (the
    entry point prints them once, on rank 0, in the run header)."""
    default = TrainConfig()
    lines = []
    for key, ignored, why in _ignored_key_rules(cfg):
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        if ignored and value != getattr(getattr(default, group), name):
            lines.append(f"warning: {key}={value!r} is ignored: {why}")
    return lines


def _validate_optional_packages(cfg: TrainConfig) -> None:
    """Optional dependencies the config asks for, found (not imported) now rather than after the models exist."""
    import importlib.util

    wanted = [
        (f"trainer.loggers={cfg.trainer.loggers}", name, f"drop {name} from trainer.loggers")
        for name in ("tensorboard", "wandb")
        if name in cfg.trainer.loggers
    ]
    if cfg.rollout.backend == "vllm":
        wanted.append(("rollout.backend=vllm", "vllm", "use rollout.backend=native"))
    for setting, package, alternative in wanted:
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"{setting}: needs the Python package {package!r}, which is not installed. Fix: "
                f"pip install -e '.[{package}]' (setup.py's extra; or pip install {package}), or {alternative}"
            )


def _validate_reward_fn(cfg: TrainConfig) -> None:
    """reward.timeout_s >= 0; import the user's reward.fn now, not after the models are built (seconds, not
    minutes, to learn of a wrong path or name)."""
    if cfg.reward.timeout_s < 0:
        _fail(
            "reward.timeout_s",
            cfg.reward.timeout_s,
            "must be >= 0",
            "give seconds per batch, or 0 for no limit",
        )
    if not cfg.reward.fn.strip():
        return
    from engine.rewards.reward_fn import load_user_fn

    try:
        load_user_fn(cfg.reward.fn)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
