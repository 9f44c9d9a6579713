"""Build everything one rank needs for a run from the validated config: tokenizer, data, model roles,
weight transition, rollout engine, reward function, metrics logger. No training logic lives here."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from algorithms.advantages import advantage_traits
from engine.config import ConfigError, ModelConfig, TrainConfig
from engine.config_rules import needs_reference
from engine.data import PromptRecord, load_prompt_dataset, load_tokenizer, refuse_row_caps
from engine.metrics import MetricsLogger
from engine.models.builder import (
    ModelShape,
    build_gpt_chunks,
    build_gpt_chunks_layout_invariant,
    resolve_shape,
)
from engine.models.hf import HFCheckpoint, check_tp_layout, load_hf_weights
from engine.models.hf_config import checkpoint_model_config
from engine.prompt_loader import PromptLoader
from engine.rewards.build import build_reward_fn
from engine.rewards.reward_fn import RewardFn
from engine.roles.dynamic_batch import micro_batch_shapes_vary
from engine.roles.memory_cap import trainer_token_cap
from engine.roles.policy import MegatronRole
from engine.roles.reward_model import RewardModel
from engine.roles.router_replay import RouterReplay
from engine.rollout import build_rollout_engine
from engine.rollout.base import RolloutEngine
from engine.tasks.embedded import build_embedded_tokenizer, write_embedded_dataset
from engine.validate.built import built_model
from engine.validate.run import layer_graphs_on, prompts_shared
from parallel.dims import ParallelDims
from parallel.expert_gather import ExpertGather
from parallel.hybrid_engine import HybridEngine
from parallel.naive_gather import NaiveGather
from parallel.rollout_weights import RolloutWeights, WeightSync
from parallel.state import ProcessGroups

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.multi_turn.episode import EpisodeRunner
    from engine.split.link import TrainerLink

EMBEDDED_TRAIN_ROWS = 4096
EMBEDDED_VAL_ROWS = 64


@dataclass
class Components:
    """What the trainer sequences; built once per rank by `build_components`."""

    cfg: TrainConfig
    groups: ProcessGroups
    output_dir: str
    tokenizer: PreTrainedTokenizerBase
    shape: ModelShape
    actor: MegatronRole
    reference: MegatronRole | None
    weight_sync: WeightSync | None
    """None under split placement (the weights go to the rollout ranks through `split`)."""
    rollout: RolloutEngine | None
    """None under split placement (the rollout ranks generate)."""
    reward_fn: RewardFn | None
    """Rule/user scores of decoded responses; None when reward.model_path scores alone (combine=model) and
    under split placement (the rollout ranks score)."""
    loader: PromptLoader
    val_batches: list[list[PromptRecord]]
    logger: MetricsLogger
    val_prompts: int = 0
    """How many prompts of `val_batches` this replica scores: the rest repeat earlier ones to even out the
    replicas' shares (`replica_val_batches`)."""
    rollout_weights: RolloutWeights | None = None
    """The actor's rollout-layout weights between `weight_sync.to_rollout()` and `to_train()`, else None."""
    critic: MegatronRole | None = None
    """The value model; built only for an advantage estimator that needs one (gae)."""
    reward_model: RewardModel | None = None
    """The frozen reward model; built only when reward.model_path is set."""
    episodes: EpisodeRunner | None = None
    """Multi-turn episodes with tools (rollout.multi_turn.enable), else None: single-turn rollouts."""
    micro_batch_token_cap: int = 0
    """Tokens per micro-batch by rows at most (engine/roles/memory_cap.py); 0: no cap."""
    share_prompts: bool = False
    """Each group's prompt once per packed micro-batch (trainer.share_prompts resolved: validate/run.py)."""
    split: TrainerLink | None = None
    """Split placement: the exchange with the rollout ranks (engine/split/link.py), else None."""


def _data_files(cfg: TrainConfig, output_dir: str) -> tuple[str, list[str], list[str]]:
    """Tokenizer dir, train files and val files; the embedded task writes its own into output_dir."""
    d = cfg.data
    tok = cfg.model.tokenizer_path or cfg.model.path  # model.path's tokenizer unless one is named
    if d.train_files:
        if not tok:
            raise ConfigError(
                "data.train_files is set but no tokenizer: set model.path or model.tokenizer_path"
            )
        return tok, list(d.train_files), list(d.val_files)
    root = os.path.join(output_dir, "embedded")
    tok = tok or build_embedded_tokenizer(os.path.join(root, "tokenizer"))  # random init: the character one
    seed = cfg.trainer.seed
    train = write_embedded_dataset(root, d.embedded_task, EMBEDDED_TRAIN_ROWS, d.embedded_digits, seed)
    val = write_embedded_dataset(
        root, d.embedded_task, EMBEDDED_VAL_ROWS, d.embedded_digits, seed + 1, split="val"
    )
    return tok, [train], list(d.val_files) or [val]


def load_prompts(
    cfg: TrainConfig,
    files: list[str],
    tokenizer,
    tool_schemas: dict[str, dict] | None,
    files_key: str,
    log: bool,
) -> list[PromptRecord]:
    """The prompts of `files` (`files_key`) as data.* and rollout.max_new_tokens say (`load_prompt_dataset`).
    With `log` (the logging rank) a line says how many prompts are not used and why: over
    data.max_prompt_len, bad rows skipped."""
    records, counts = load_prompt_dataset(
        files,
        tokenizer,
        cfg.data.max_prompt_len,
        cfg.data.bad_rows,
        files_key,
        tool_schemas,
        cfg.rollout.max_new_tokens,
    )
    if log and (counts["too_long"] or counts["bad"]):
        print(
            f"data: kept {counts['kept']} of {counts['rows']} prompts of {files_key} "
            f"({counts['too_long']} over data.max_prompt_len, {counts['bad']} bad rows skipped)",
            flush=True,
        )
    return records


def replica_val_batches(
    records: list[PromptRecord], dp: int, rank: int, per_rank: int
) -> list[list[PromptRecord]]:
    """Training replica `rank`'s validation batches of `per_rank` prompts among `dp` replicas (the rollout
    ranks of split placement ask for the replicas they serve): prompt i goes to replica i % dp. Every
    replica must run as many validation rollouts (their weight transitions are collective across replicas
    under expert parallelism, and a rank with no batch would skip validation), so when len(records) is not
    a multiple of dp the replicas short of one prompt run a repeat of the first prompts at the end of their
    last batch, which `validate` drops before scoring counts (`replica_val_prompts`): every prompt is scored
    once, as verl pads and unpads."""
    if not records:
        return []
    padded = -(-len(records) // dp) * dp
    mine = [records[i % len(records)] for i in range(rank, padded, dp)]
    return [mine[i : i + per_rank] for i in range(0, len(mine), per_rank)]


def replica_val_prompts(num_records: int, dp: int, rank: int) -> int:
    """How many of `replica_val_batches`' prompts of replica `rank` are not repeats: they come first."""
    return len(range(rank, num_records, dp))


def model_shape(model: ModelConfig, tokenizer_vocab: int, tp: int) -> ModelShape:
    """The architecture: from `model.path`'s config.json when set (`checkpoint_model_config`: dtype, recompute
    and the MoE training settings stay the config's), else from the model config with the tokenizer's
    vocabulary."""
    if not model.path:
        return resolve_shape(model, tokenizer_vocab, tp)
    checkpoint = checkpoint_model_config(model)
    shape = resolve_shape(checkpoint, checkpoint.vocab_size, tp)
    check_tp_layout(shape, tp, f"{model.path}/config.json")
    return shape


def build_policy_chunks(cfg: TrainConfig, shape: ModelShape, groups: ProcessGroups) -> list:
    """Actor/reference chunks: loaded from `model.path`, or seeded random init (same on every DP replica)."""
    torch.manual_seed(cfg.trainer.seed)
    # a random init is the same model at every parallel.pp, vpp and ep
    build = build_gpt_chunks if cfg.model.path else build_gpt_chunks_layout_invariant
    chunks = build(shape, groups, init_std=cfg.model.init_std, recompute=cfg.model.recompute)
    if cfg.model.path:
        load_hf_weights(chunks, cfg.model.path, shape, groups)
    return chunks


def build_critic(
    cfg: TrainConfig, actor_shape: ModelShape, vocab_size: int, groups: ProcessGroups, total_steps: int
) -> MegatronRole:
    """The critic: the actor's architecture and layout with a zero-initialised scalar value head; backbone
    (and `score.weight` if present) from critic.path, else model.path, else the actor's seeded random init."""
    path = cfg.critic.path or cfg.model.path
    shape = actor_shape
    if path != cfg.model.path:
        shape = model_shape(replace(cfg.model, path=path), vocab_size, groups.dims.tp)
        if shape.vocab_size < vocab_size:
            raise ConfigError(
                f"critic.path={path!r} has a vocabulary of {shape.vocab_size} tokens, fewer than the "
                f"tokenizer's {vocab_size}: point critic.path at a model of the actor's family"
            )
    torch.manual_seed(cfg.trainer.seed)
    build = (
        build_gpt_chunks if path else build_gpt_chunks_layout_invariant
    )  # a random init: one model at any layout
    chunks = build(shape, groups, init_std=cfg.model.init_std, recompute=cfg.model.recompute, value_head=True)
    if path:
        load_hf_weights(chunks, path, shape, groups)
    c = cfg.critic
    optim = replace(cfg.optim, lr=c.lr, min_lr=min(cfg.optim.min_lr, c.lr), lr_warmup_steps=c.lr_warmup_steps)
    return MegatronRole(chunks, groups, shape, optim, total_optimizer_steps=total_steps, head="values")


def build_reward_model(cfg: TrainConfig, vocab_size: int, groups: ProcessGroups, pad_id: int) -> RewardModel:
    """The frozen reward model from reward.model_path: the actor's layout and dtype, its value head from
    the checkpoint's `score.weight` (required)."""
    path = cfg.reward.model_path
    shape = model_shape(replace(cfg.model, path=path), vocab_size, groups.dims.tp)
    if shape.vocab_size < vocab_size:
        raise ConfigError(
            f"reward.model_path={path!r} has a vocabulary of {shape.vocab_size} tokens, fewer than the "
            f"tokenizer's {vocab_size}: the reward model must share the actor's tokenizer"
        )
    with HFCheckpoint(path) as ckpt:
        if "score.weight" not in ckpt:
            raise ConfigError(
                f"reward.model_path={path!r} has no score.weight: point it at a trained reward model "
                "(*ForSequenceClassification with num_labels=1)"
            )
    chunks = build_gpt_chunks(
        shape,
        groups,
        init_std=cfg.model.init_std,
        recompute=False,
        value_head=True,
    )
    load_hf_weights(chunks, path, shape, groups)
    role = MegatronRole(chunks, groups, shape, None, head="values")
    return RewardModel(role, pad_id, seq_multiple=groups.dims.seq_multiple)


def _variable_shapes(roles: list[MegatronRole | None], cfg: TrainConfig, dims: ParallelDims) -> None:
    """Packed or token-budget micro-batches differ in shape: with PP, let the stages exchange shapes first."""
    if micro_batch_shapes_vary(cfg.trainer, dims.vpp) and dims.pp > 1:
        for role in roles:
            if role is not None:
                role.config.variable_seq_lengths = True


def build_weight_sync_and_rollout(
    cfg: TrainConfig, actor_chunks: list, shape: ModelShape, groups: ProcessGroups, pad_id: int
) -> tuple[WeightSync, RolloutEngine]:
    """The train -> rollout weight sync of `actor_chunks` (rollout.weight_sync) and the rollout engine
    (rollout.backend) that generates on what it hands over."""
    if cfg.rollout.weight_sync == "naive":
        weight_sync = NaiveGather(actor_chunks, groups, shape.num_layers, shape.tie_embeddings)
    else:
        weight_sync = HybridEngine(
            actor_chunks,
            groups,
            shape.num_layers,
            shape.tie_embeddings,
            rollout_tp=cfg.rollout.tp,
            keep_rollout_weights=cfg.rollout.keep_rollout_weights,
            skip_experts=groups.dims.ep > 1,
        )
    if shape.moe is not None and groups.dims.ep > 1:  # the rollout runs every expert of its layers
        weight_sync = ExpertGather(
            weight_sync,
            actor_chunks,
            groups,
            shape.num_layers,
            shape.moe.num_experts,
            rollout_layers=[range(shape.num_layers)],  # rollout PP is 1
            keep_rollout_weights=cfg.rollout.keep_rollout_weights,
        )
    rollout = build_rollout_engine(
        cfg.rollout, shape, groups.device, pad_id, model_dir=cfg.model.path, seed=cfg.trainer.seed
    )
    return weight_sync, rollout


def build_components(cfg: TrainConfig, groups: ProcessGroups, output_dir: str) -> Components:
    dims = groups.dims
    tok_dir, train_files, val_files = _data_files(cfg, output_dir)
    tokenizer = load_tokenizer(
        tok_dir, key="model.path" if tok_dir == cfg.model.path else "model.tokenizer_path"
    )
    tools = build_episode_tools(cfg)
    schemas = {name: tool.schema for name, tool in tools.items()} if tools else None
    log = groups.is_logging_rank
    records = load_prompts(cfg, train_files, tokenizer, schemas, "data.train_files", log)
    loader = PromptLoader(
        records,
        cfg.data.batch_size,
        cfg.trainer.seed,
        groups.dp_rank,
        dims.dp,
        cfg.data.shuffle,
        num_mini_batches=cfg.algorithm.num_mini_batches,
    )
    note = loader.tail_note()
    if log and note:
        print(note, flush=True)
    val_records = []
    if val_files:
        val_records = load_prompts(cfg, val_files, tokenizer, schemas, "data.val_files", log)
    if cfg.rollout.multi_turn.enable:
        refuse_row_caps(records, "data.train_files")
        refuse_row_caps(val_records, "data.val_files")
    shape = model_shape(cfg.model, len(tokenizer), dims.tp)
    actor_chunks = build_policy_chunks(cfg, shape, groups)
    alg = cfg.algorithm
    reference = None
    if needs_reference(alg):
        ref_chunks = build_policy_chunks(cfg, shape, groups)
        if not cfg.model.path:  # random init: the reference starts as a copy of the actor
            for ref, act in zip(ref_chunks, actor_chunks):
                ref.load_state_dict(act.state_dict())
        reference = MegatronRole(ref_chunks, groups, shape, None)
    steps = cfg.trainer.total_steps * alg.ppo_epochs * alg.num_mini_batches
    actor = MegatronRole(actor_chunks, groups, shape, cfg.optim, total_optimizer_steps=steps)
    if alg.router_replay:  # the actor's forwards replay the rollout's expert choices
        actor.router_replay = RouterReplay(
            actor.models, actor.config, groups.tp_rank, groups.world, groups.device
        )
    critic = (
        build_critic(cfg, shape, len(tokenizer), groups, steps)
        if advantage_traits(alg.adv_estimator).needs_critic and not cfg.placement.critic_ranks
        else None  # placement.critic_ranks: the critic trains on its own ranks (engine/split/critic.py)
    )
    reward_model = None
    if cfg.reward.model_path:
        reward_model = build_reward_model(cfg, len(tokenizer), groups, tokenizer.pad_token_id)
    _variable_shapes([actor, reference, critic, reward_model and reward_model.role], cfg, dims)
    built = built_model(cfg)
    if layer_graphs_on(cfg, built):  # engine/models/layer_graphs.py
        for role in (actor, reference, critic):
            if role is not None:
                role.use_cuda_graphs()
    weight_sync, rollout = None, None
    if cfg.placement.mode != "split":  # split: engine/split/run.py connects the rollout ranks
        weight_sync, rollout = build_weight_sync_and_rollout(
            cfg, actor.chunks, shape, groups, tokenizer.pad_token_id
        )
    reward_fn = None
    scores_here = cfg.placement.mode != "split"  # split: the rollout ranks score (engine/split/worker.py)
    if scores_here and (not reward_model or cfg.reward.combine == "sum"):
        reward_fn = build_reward_fn(
            cfg.reward.fn, gsm8k_method=cfg.reward.gsm8k_method, timeout_s=cfg.reward.timeout_s
        )
        reward_fn.check_data_sources([r.data_source for r in records])
    episodes = build_episodes(cfg, tools, tokenizer, shape, records + val_records)
    roles = [actor, reference, critic, reward_model and reward_model.role]
    token_cap = trainer_token_cap(cfg, shape, groups, roles)  # after every model: their memory is taken
    logger = MetricsLogger(  # after the cap's startup line: the progress bar starts here
        output_dir,
        list(cfg.trainer.loggers),
        groups.is_logging_rank,
        cfg.trainer.total_steps,
        cfg.trainer.progress_bar,
    )
    return Components(
        cfg=cfg,
        groups=groups,
        output_dir=output_dir,
        tokenizer=tokenizer,
        shape=shape,
        actor=actor,
        reference=reference,
        weight_sync=weight_sync,
        rollout=rollout,
        reward_fn=reward_fn,
        loader=loader,
        val_batches=replica_val_batches(val_records, dims.dp, groups.dp_rank, cfg.data.batch_size // dims.dp),
        val_prompts=replica_val_prompts(len(val_records), dims.dp, groups.dp_rank),
        logger=logger,
        critic=critic,
        reward_model=reward_model,
        episodes=episodes,
        micro_batch_token_cap=token_cap,
        share_prompts=prompts_shared(cfg, built),
    )


def build_episode_tools(cfg: TrainConfig) -> dict | None:
    """The tools of rollout.multi_turn.tools by name, None when multi-turn is off."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    from engine.multi_turn.tools import build_tools

    return build_tools(mt.tools, timeout_s=mt.tool_timeout_s, sandbox_memory_mb=mt.sandbox_memory_mb)


def build_episodes(
    cfg: TrainConfig, tools: dict | None, tokenizer, shape: ModelShape, records: list[PromptRecord]
) -> EpisodeRunner | None:
    """The multi-turn episode runner with `tools` (None: multi-turn is off); every tool a data row names must
    be among them."""
    if tools is None:
        return None
    from engine.multi_turn.episode import EpisodeRunner

    mt = cfg.rollout.multi_turn
    runner = EpisodeRunner(mt, tokenizer, tools, shape.max_position_embeddings, tokenizer.pad_token_id)
    for record in records:
        unknown = sorted(set(record.tools) - set(runner.tools))
        if unknown:
            raise ConfigError(
                f"data row {record.index} names tools {unknown} that rollout.multi_turn.tools={list(mt.tools)} "
                f"does not provide (it has {sorted(runner.tools)}). Fix: add them to rollout.multi_turn.tools "
                "(built-in names or module:function) or remove them from the row's `tools` column"
            )
    return runner
