"""Placement: which ranks train and which generate (`placement.*`), the rollout side's own layout under split
placement, and the settings split placement does not run with."""

from __future__ import annotations

from algorithms.advantages import advantage_traits
from engine.config import ModelConfig, TrainConfig
from engine.validate.built import model_key
from engine.validate.rules import fail, one_of
from parallel.dims import ParallelDims

MODES = ("colocated", "split")


def training_world_size(cfg: TrainConfig, world_size: int) -> int:
    """The ranks that train the actor: the whole world when colocated, else the world minus the rollout (and
    critic) ranks. Checks the rank counts against the world; runs before the training layout is validated."""
    p = cfg.placement
    one_of("placement.mode", p.mode, MODES)
    t = cfg.trainer
    if t.off_policy_steps not in (0, 1):
        fail(
            "trainer.off_policy_steps",
            t.off_policy_steps,
            "must be 0 (on-policy) or 1 (the rollout runs one step ahead)",
            "use trainer.off_policy_steps=0 or 1",
        )
    if p.mode == "colocated":
        for key, value in (
            ("placement.rollout_ranks", p.rollout_ranks),
            ("placement.critic_ranks", p.critic_ranks),
            ("trainer.off_policy_steps", t.off_policy_steps),
        ):
            if value:
                fail(
                    key,
                    value,
                    "needs placement.mode=split (colocated: every rank trains and generates)",
                    f"set placement.mode=split, or {key}=0",
                )
        return world_size
    if p.rollout_ranks < 1:
        fail(
            "placement.rollout_ranks",
            p.rollout_ranks,
            "placement.mode=split needs at least one rollout rank",
            f"set placement.rollout_ranks to 1..{max(world_size - 1, 1)}, or placement.mode=colocated",
        )
    if p.critic_ranks < 0:
        fail(
            "placement.critic_ranks",
            p.critic_ranks,
            "must be >= 0",
            "use 0 to train the critic on the actor's ranks",
        )
    train = world_size - p.rollout_ranks - p.critic_ranks
    if train < 1:
        fail(
            "placement.rollout_ranks + placement.critic_ranks",
            p.rollout_ranks + p.critic_ranks,
            f"leaves {train} of the {world_size} ranks (torchrun --nproc_per_node x nodes) to train the actor",
            "launch more ranks or lower placement.rollout_ranks / placement.critic_ranks",
        )
    mp = cfg.parallel.tp * cfg.parallel.pp
    if train % mp:
        fail(
            "placement.rollout_ranks",
            p.rollout_ranks,
            f"leaves {train} training ranks of the {world_size}, not a multiple of parallel.tp x parallel.pp = "
            f"{mp} (the actor's training layout covers the ranks before the rollout ranks)",
            "change placement.rollout_ranks, the number of ranks launched, or parallel.tp / parallel.pp",
        )
    if p.critic_ranks:
        if not advantage_traits(cfg.algorithm.adv_estimator).needs_critic:
            fail(
                "placement.critic_ranks",
                p.critic_ranks,
                f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} has no critic",
                "set placement.critic_ranks=0 (only algorithm.adv_estimator=gae trains a critic)",
            )
        if cfg.rollout.backend == "vllm":
            fail(
                "placement.critic_ranks",
                p.critic_ranks,
                "with rollout.backend=vllm is not built: vLLM's start spans every rank, and the critic ranks "
                "start no idle engine",
                "set placement.critic_ranks=0 (the critic on the actor's ranks), or rollout.backend=native",
            )
    return train


def critic_dims(cfg: TrainConfig, dims: ParallelDims) -> ParallelDims | None:
    """The critic's layout on its own ranks (placement.critic_ranks), None when it shares the actor's: TP and PP
    from placement.critic_tp / critic_pp (0 = the actor's), its DP the actor's, no VPP nor SP."""
    p = cfg.placement
    if p.mode != "split" or not p.critic_ranks:
        return None
    return ParallelDims(world_size=p.critic_ranks, tp=p.critic_tp or dims.tp, pp=p.critic_pp or dims.pp)


def _check_critic_layout(cfg: TrainConfig, actor_dp: int, built: ModelConfig) -> None:
    """placement.critic_ranks: TP x PP x the actor's DP, the built model's widths and layers split by them."""
    p = cfg.placement
    for key, value in (("placement.critic_tp", p.critic_tp), ("placement.critic_pp", p.critic_pp)):
        if value < 0:
            fail(key, value, "must be >= 0", f"use {key}=0 for the actor's size, or a positive size")
    tp, pp = p.critic_tp or cfg.parallel.tp, p.critic_pp or cfg.parallel.pp
    if p.critic_ranks != tp * pp * actor_dp:
        fail(
            "placement.critic_ranks",
            p.critic_ranks,
            f"must be critic TP x PP x the actor's DP = {tp} x {pp} x {actor_dp} = {tp * pp * actor_dp} "
            "(placement.critic_tp / critic_pp, 0 = parallel.tp / pp; critic replica d serves actor replica d)",
            f"set placement.critic_ranks={tp * pp * actor_dp}, or change placement.critic_tp / critic_pp",
        )
    for key, value in _model_widths(cfg, built):
        if value % tp:
            fail(
                "placement.critic_tp",
                tp,
                f"must divide {key}={value} (each critic rank holds 1/critic_tp of every head and width)",
                "pick a placement.critic_tp that divides the model's head counts and ffn width",
            )
    if built.num_layers % pp:
        layers = model_key(cfg, "num_layers")
        fail(
            "placement.critic_pp",
            pp,
            f"must divide {layers}={built.num_layers} (the critic's stages split the layers evenly)",
            f"pick a placement.critic_pp that divides {layers}",
        )


def validate_placement(cfg: TrainConfig, dims: ParallelDims, built: ModelConfig) -> None:
    """Split placement: the critic ranks' layout, the rollout side's layout (rollout.tp x rollout DP over
    placement.rollout_ranks, the heads and widths of `built`, the model the run builds, split by rollout.tp,
    whole prompts per rollout replica) and the settings split placement does not run with. Nothing to check
    when colocated (engine/validate/rollout.py covers it)."""
    p, r = cfg.placement, cfg.rollout
    if p.mode != "split":
        return
    if p.critic_ranks:
        _check_critic_layout(cfg, dims.dp, built)
    if r.tp < 1 or p.rollout_ranks % r.tp:
        divisors = [d for d in range(1, p.rollout_ranks + 1) if p.rollout_ranks % d == 0]
        fail(
            "rollout.tp",
            r.tp,
            f"must divide placement.rollout_ranks={p.rollout_ranks} (rollout DP = rollout_ranks / rollout.tp)",
            f"use rollout.tp in {divisors}",
        )
    for key, value in _model_widths(cfg, built):
        if value % r.tp:
            fail(
                "rollout.tp",
                r.tp,
                f"must divide {key}={value} (each rollout rank holds 1/rollout.tp of every head and width)",
                "pick a rollout.tp that divides the model's head counts and ffn width",
            )
    rollout_dp = p.rollout_ranks // r.tp
    if cfg.data.batch_size % rollout_dp:
        fail(
            "data.batch_size",
            cfg.data.batch_size,
            f"must be divisible by the rollout DP size {rollout_dp} (= placement.rollout_ranks / rollout.tp) "
            "so that every rollout replica generates whole prompts",
            f"use a multiple of {rollout_dp}",
        )
    _refuse_unsupported_with_split(cfg)
    if r.backend == "vllm" and dims.world_size % r.tp:
        fail(
            "rollout.tp",
            r.tp,
            f"with rollout.backend=vllm must divide the {dims.world_size} training ranks: vLLM groups consecutive "
            "ranks of the whole job into TP groups, so the rollout ranks' TP groups line up only when the "
            "training ranks before them fill whole groups",
            "change placement.rollout_ranks or the number of ranks launched, or use rollout.backend=native",
        )
    if cfg.trainer.off_policy_steps and cfg.algorithm.tis_cap <= 0:
        fail(
            "trainer.off_policy_steps",
            cfg.trainer.off_policy_steps,
            "trains on responses of the previous step's weights, which needs the importance correction with "
            "the rollout's log-probs (algorithm.tis_cap > 0; algorithm.tis_mode=truncate or mask)",
            "set algorithm.tis_cap (e.g. 2.0), or trainer.off_policy_steps=0",
        )


def _model_widths(cfg: TrainConfig, built: ModelConfig) -> list[tuple[str, int]]:
    """(key, value) of the built model's sizes that TP splits."""
    fields = ("num_attention_heads", "num_query_groups", "ffn_hidden_size")
    return [(model_key(cfg, field), getattr(built, field)) for field in fields]


def _refuse_unsupported_with_split(cfg: TrainConfig) -> None:
    """Settings whose split-placement path is not built: refused here rather than run differently."""
    if cfg.reward.model_path and advantage_traits(cfg.algorithm.adv_estimator).needs_greedy_baseline:
        fail(
            "reward.model_path",
            cfg.reward.model_path,
            f"with placement.mode=split and algorithm.adv_estimator={cfg.algorithm.adv_estimator} is not "
            "supported: the reward model runs on the training ranks, which receive only the sampled responses, "
            "not the greedy baseline's",
            "use a rule or reward.fn, another estimator (e.g. grpo, rloo), or placement.mode=colocated",
        )
