"""The optimizer, trainer (checkpoints, output directory, loggers) and reward groups, and the optional packages
the config asks for."""

from __future__ import annotations

import os

from engine.checkpoint.store import CHECKPOINTS_DIR
from engine.config import LOGGERS, ConfigError, ModelConfig, TrainConfig
from engine.data import check_files_exist
from engine.micro_batch_sizing import packs_sequences, sized_by_memory
from engine.validate.model import validate_checkpoint_positions
from engine.validate.rules import fail, one_of, positive


def validate_cuda_graphs(cfg: TrainConfig, built: ModelConfig) -> None:
    """trainer.cuda_graphs=true (engine/models/layer_graphs.py) where the layers' graphs cannot replay is
    refused, naming the first reason (`layer_graphs_blockers`)."""
    if cfg.trainer.cuda_graphs:
        for rule, fix in layer_graphs_blockers(cfg, built)[:1]:
            fail("trainer.cuda_graphs", True, rule, fix)


def validate_share_prompts(cfg: TrainConfig, built: ModelConfig) -> None:
    """trainer.share_prompts=true (engine/roles/shared_prompts.py) where its layout cannot run is refused, naming
    the first reason (`share_prompts_blockers`)."""
    if cfg.trainer.share_prompts:
        for rule, fix in share_prompts_blockers(cfg, built)[:1]:
            fail("trainer.share_prompts", True, rule, fix)


def share_prompts_blockers(cfg: TrainConfig, built: ModelConfig) -> list[tuple[str, str]]:
    """(rule, fix) for each reason each group's prompt cannot be laid out once per micro-batch."""
    t, off = cfg.trainer, "or set trainer.share_prompts=false"
    checks = (
        (not packs_sequences(t), "needs packed micro-batches (trainer.pack_sequences=false)", "drop it"),
        (
            cfg.parallel.vpp > 1,
            f"needs micro-batches of free shapes (parallel.vpp={cfg.parallel.vpp})",
            "set 1",
        ),
        (
            t.cuda_graphs is True,
            "changes every micro-batch's layout: no CUDA graphs of the layers",
            "drop it",
        ),
        (
            built.moe.num_experts > 0,
            "is not built for mixture-of-experts models (the router's losses count every row's prompt)",
            "drop it",
        ),
    )
    return [(rule, f"{fix}, {off}") for bad, rule, fix in checks if bad]


def prompts_shared(cfg: TrainConfig, built: ModelConfig) -> bool:
    """Whether each group's prompt is laid out once per packed micro-batch (trainer.share_prompts): as set, or
    where it is empty, wherever nothing blocks it (`share_prompts_blockers`), the rollout samples more than one
    response per prompt, and the layers do not run from CUDA graphs (`layer_graphs_on`: on by default where
    micro-batches are cut by rows on a GPU, whose fixed layouts sharing would change). The same results
    (tests at TP=2 x PP=2 with SP and on the GPU against whole rows), fewer tokens; measured in
    scripts/bench/README.md, "End to end"."""
    setting = cfg.trainer.share_prompts
    if setting is not None:
        return setting
    shareable = cfg.rollout.n > 1 and not share_prompts_blockers(cfg, built)
    return shareable and not layer_graphs_on(cfg, built)


def layer_graphs_on(cfg: TrainConfig, built: ModelConfig) -> bool:
    """Whether the run's layers run from CUDA graphs: trainer.cuda_graphs=true (validated), or left empty
    where nothing blocks them, the model is bfloat16 (float16's loss scaling is not yet run with them) and
    micro-batches are cut by rows (engine/micro_batch_sizing.py: trainer.micro_batch_size set, or padded rows;
    no token budget, and not grown to MEMORY_SIZED_TOKENS by `sized_by_memory`), small enough that the host
    bounds them. One H200, GRPO steps, each pair in one call (scripts/bench/README.md "Update", 2026-12-04):
    8 rows, 0.5B 10.14 -> 5.10 s and 1.5B 12.47 -> 9.34 s at fixed 512-token responses, 0.5B 7.31 -> 5.09 s
    on a long tail to 1,024 (earlier calls on a faster host: 1.5B 9.34 -> 9.50 s). Under a 32,768-token
    budget, GPU-bound, they cost: 0.5B 3.82 -> 4.31 s, 1.5B 8.66 -> 8.76 s (nothing captured there).
    `built`: the model the run builds (validate/built.py)."""
    setting, t = cfg.trainer.cuda_graphs, cfg.trainer
    if setting is None:
        by_rows = (
            t.share_prompts is not True
            and not t.max_tokens_per_micro_batch
            and not sized_by_memory(t, cfg.cluster.device, cfg.parallel.pp)
        )
        return by_rows and built.dtype == "bfloat16" and not layer_graphs_blockers(cfg, built)
    return setting


def layer_graphs_blockers(cfg: TrainConfig, built: ModelConfig) -> list[tuple[str, str]]:
    """(rule, fix) for each reason the layers' CUDA graphs cannot run: they replay whole layers one
    micro-batch at a time on CUDA, their shapes fixed at capture (no pipeline stages in flight, no host-side
    routing counts)."""
    off = "or set trainer.cuda_graphs=false"
    checks = (
        (
            cfg.cluster.device != "cuda",
            "captures CUDA graphs: needs cluster.device=cuda",
            "turn it off on CPU",
        ),
        (
            cfg.parallel.pp > 1,
            f"replays one micro-batch at a time: no pipeline parallelism (parallel.pp={cfg.parallel.pp})",
            f"set parallel.pp=1 {off}",
        ),
        (
            cfg.parallel.tp > 1,
            f"is built and tested at parallel.tp=1 only (parallel.tp={cfg.parallel.tp})",
            f"set parallel.tp=1 (data parallelism is fine) {off}",
        ),
        (
            cfg.model.recompute,
            "does not capture recomputed layers (model.recompute=true)",
            f"set model.recompute=false {off}",
        ),
        (
            built.moe.num_experts > 0,
            "does not capture mixture-of-experts layers (their routing sizes tokens on the host)",
            "set trainer.cuda_graphs=false",
        ),
        (
            packs_sequences(cfg.trainer) and built.dtype == "float32",
            "captures packed attention through FlashAttention-2, which needs half precision: in float32 "
            "packed rows run one by one after a host sync (model.dtype=float32)",
            f"set model.dtype=bfloat16, or trainer.pack_sequences=false, {off}",
        ),
    )
    return [(rule, fix) for bad, rule, fix in checks if bad]


def validate_optim(cfg: TrainConfig) -> None:
    o = cfg.optim
    positive("optim.lr", o.lr)
    if o.min_lr < 0 or o.min_lr > o.lr:
        fail("optim.min_lr", o.min_lr, f"must lie in [0, optim.lr={o.lr}]", "lower optim.min_lr")
    one_of("optim.lr_decay", o.lr_decay, ("constant", "linear", "cosine"))
    if o.clip_grad < 0:
        fail("optim.clip_grad", o.clip_grad, "must be >= 0", "use 1.0, or 0 to turn clipping off")
    if o.lr_warmup_steps < 0:
        fail("optim.lr_warmup_steps", o.lr_warmup_steps, "must be >= 0", "use 0 for no warm-up")
    positive("optim.initial_loss_scale", o.initial_loss_scale)
    for key, value in (("optim.adam_beta1", o.adam_beta1), ("optim.adam_beta2", o.adam_beta2)):
        if not 0.0 <= value < 1.0:
            fail(key, value, "must lie in [0, 1)", "use 0.9 for adam_beta1 and 0.999 for adam_beta2")
    positive("optim.adam_eps", o.adam_eps)
    if o.weight_decay < 0:
        fail("optim.weight_decay", o.weight_decay, "must be >= 0", "use 0.0 (off) or e.g. 0.01")
    positive("cluster.peak_tflops", cfg.cluster.peak_tflops)


def validate_trainer(cfg: TrainConfig) -> None:
    t = cfg.trainer
    positive("trainer.total_steps", t.total_steps)
    if t.seed < 0:
        fail(
            "trainer.seed",
            t.seed,
            "must be >= 0 (numpy's seeded generators take no negative seeds)",
            "use 0 or above",
        )
    for name in t.loggers:
        one_of("trainer.loggers", name, LOGGERS)
    for key, value in (
        ("trainer.save_freq", t.save_freq),
        ("trainer.test_freq", t.test_freq),
        ("trainer.max_checkpoints", t.max_checkpoints),
    ):
        if value < 0:
            fail(key, value, "must be >= 0", "use 0 to turn it off")
    outside = [s for s in t.profile_steps if not 1 <= s <= t.total_steps]
    if outside:
        fail(
            "trainer.profile_steps",
            list(t.profile_steps),
            f"names steps outside 1..trainer.total_steps={t.total_steps}: {outside}",
            "name steps as the log counts them, from 1",
        )
    if t.output_dir and os.path.exists(t.output_dir) and not os.path.isdir(t.output_dir):
        fail(
            "trainer.output_dir",
            t.output_dir,
            "is a file, not a directory",
            "point it at a directory (new or a run's)",
        )
    check_files_exist(cfg.data.train_files, "data.train_files")  # a data error (status 1), before any group
    check_files_exist(cfg.data.val_files, "data.val_files")
    if t.val_before_train and cfg.placement.mode == "split":
        fail(
            "trainer.val_before_train",
            True,
            "runs with colocated placement only (placement.mode=split's rollout ranks validate after steps)",
            "set trainer.val_before_train=false and validate after the first step with trainer.test_freq=1",
        )
    if t.resume == "auto" and not t.output_dir:
        fail(
            "trainer.resume",
            "auto",
            "looks for checkpoints in trainer.output_dir, which is empty (Hydra's run dir is new every run)",
            "set trainer.output_dir to the run's directory",
        )
    if t.resume not in ("auto", "off") and not os.path.isdir(t.resume):
        fail(
            "trainer.resume",
            t.resume,
            "is neither auto, off nor an existing checkpoint directory",
            "use trainer.resume=auto to continue from the latest checkpoint in trainer.output_dir",
        )
    here = os.path.join(t.output_dir, CHECKPOINTS_DIR)
    branch = os.path.realpath(os.path.dirname(os.path.normpath(t.resume))) == os.path.realpath(here)
    if t.overwrite and t.resume not in ("auto", "off") and not branch:
        fail(
            "trainer.overwrite",
            True,
            f"has no effect with trainer.resume={t.resume}, not a checkpoint of trainer.output_dir (a "
            f"resumed run keeps the directory's outputs; overwrite only lets a resume branch from an "
            f"older checkpoint of {here})",
            "drop trainer.overwrite, or use trainer.resume=off to start fresh",
        )


def validate_reward(cfg: TrainConfig) -> None:
    from engine.rewards.gsm8k import METHODS as GSM8K_METHODS
    from engine.roles.reward_model import check_reward_model_dir

    r = cfg.reward
    one_of("reward.combine", r.combine, ("model", "sum"))
    one_of("reward.gsm8k_method", r.gsm8k_method, GSM8K_METHODS)
    if r.model_path and r.combine == "model" and r.fn:
        fail(
            "reward.fn",
            r.fn,
            "would be ignored: reward.combine=model scores with the reward model alone",
            "set reward.combine=sum to add it to the model's score, or reward.fn=''",
        )
    validate_reward_fn(cfg)
    if not r.model_path:
        return
    if os.path.isdir(r.model_path):
        validate_checkpoint_positions(cfg, "reward.model_path", r.model_path)
    why = check_reward_model_dir(r.model_path)
    if why:
        fail(
            "reward.model_path",
            r.model_path,
            why,
            "point it at a local HF reward model saved with save_pretrained (num_labels=1)",
        )


def validate_reward_fn(cfg: TrainConfig) -> None:
    """reward.timeout_s >= 0; import the user's reward.fn now, not after the models are built (seconds, not
    minutes, to learn of a wrong path or name)."""
    if cfg.reward.timeout_s < 0:
        fail(
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


def validate_optional_packages(cfg: TrainConfig) -> None:
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
