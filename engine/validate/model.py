"""The layout and the model: parallel sizes, the stage split, the architecture, and what a checkpoint directory's
config.json and tokenizer files must hold (read as files: no megatron, no transformers)."""

from __future__ import annotations

import json
import os

from engine.config import DTYPES, ConfigError, ModelConfig, TrainConfig
from engine.validate.built import built_model, model_key
from engine.validate.rules import fail, one_of, positive
from parallel.dims import ParallelDims


def validate_parallel(cfg: TrainConfig, world_size: int) -> ParallelDims:
    if cfg.cluster.device not in ("cpu", "cuda"):
        fail(
            "cluster.device",
            cfg.cluster.device,
            "must be cpu or cuda",
            "pick cluster=cpu or cluster=single_gpu",
        )
    positive("cluster.timeout_s", cfg.cluster.timeout_s)
    if cfg.cluster.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail("cluster.device", "cuda", "no CUDA device is visible", "use cluster=cpu on this machine")
    try:
        return ParallelDims(
            world_size=world_size,
            tp=cfg.parallel.tp,
            pp=cfg.parallel.pp,
            vpp=cfg.parallel.vpp,
            sp=cfg.parallel.sp,
            first_stage_layers=cfg.parallel.first_stage_layers,
            last_stage_layers=cfg.parallel.last_stage_layers,
            ep=cfg.parallel.ep,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None


def validate_stage_layers(cfg: TrainConfig, dims: ParallelDims, built: ModelConfig) -> None:
    """Every model's layers split over the pipeline stages (megatron's uneven first/last stages): the
    actor's (`built`: model.num_layers, or model.path's config.json), the critic's and the reward model's."""
    counts = [(model_key(cfg, "num_layers"), built.num_layers)]
    for key, path in (("critic.path", cfg.critic.path), ("reward.model_path", cfg.reward.model_path)):
        config_file = os.path.join(path, "config.json")
        if path and os.path.isfile(config_file):
            try:
                with open(config_file) as f:
                    num_layers = json.load(f).get("num_hidden_layers")  # absent: named when it is read
            except (OSError, ValueError, AttributeError):  # unreadable: named by the positions check
                continue
            if isinstance(num_layers, int) and num_layers > 0:
                counts.append((f"{key}'s {config_file}: num_hidden_layers", num_layers))
    for key, num_layers in counts:
        try:
            dims.stage_layer_counts(num_layers)
        except ValueError as err:
            raise ConfigError(f"{key}={num_layers}: {err}") from None


def validate_model(cfg: TrainConfig, dims: ParallelDims) -> ModelConfig:
    """model.*, checked on the model the run builds (`built_model`: model.path's config.json architecture
    when set); returns that model for the other groups' checks."""
    m = cfg.model
    if m.path:
        if not os.path.isdir(m.path):
            fail(
                "model.path",
                m.path,
                "is not a directory",
                "point model.path at a local Hugging Face checkpoint directory",
            )
        validate_checkpoint_positions(cfg, "model.path", m.path)  # config.json readable first
    one_of("model.dtype", m.dtype, DTYPES)
    built = built_model(cfg)
    for field in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        positive(model_key(cfg, field), getattr(built, field))
    validate_moe(cfg, dims, built)
    validate_stage_layers(cfg, dims, built)
    if m.path:
        validate_tokenizer_source(cfg)
    else:  # with model.path, `checkpoint_model_config` refused what of config.json the engine cannot build
        validate_configured_architecture(cfg)
    validate_vocab_holds_tokenizer(cfg, built)
    for field in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        value = getattr(built, field)
        if value % dims.tp:
            fail(
                model_key(cfg, field),
                value,
                f"must be divisible by parallel.tp={dims.tp}",
                "lower parallel.tp or change the model",
            )
    return built


def validate_configured_architecture(cfg: TrainConfig) -> None:
    """The model.* architecture keys of a model without model.path: sizes that fit one another and the
    longest sequence."""
    m = cfg.model
    if m.head_dim < 0 or m.head_dim % 2:
        fail(
            "model.head_dim",
            m.head_dim,
            "must be 0 (hidden / heads) or a positive even number (RoPE rotates pairs)",
            "use 0 or e.g. 64",
        )
    if m.vocab_size < 0:
        fail(
            "model.vocab_size",
            m.vocab_size,
            "must be >= 0",
            "use 0 (the tokenizer's size) or a positive size",
        )
    if m.init_std < 0:
        fail("model.init_std", m.init_std, "must be >= 0", "use 0.02")
    positive("model.rope_theta", m.rope_theta)
    positive("model.norm_eps", m.norm_eps)
    if m.rope_scaling_factor < 0:
        fail(
            "model.rope_scaling_factor",
            m.rope_scaling_factor,
            "must be >= 0",
            "use 0 (off) or Llama-3's factor (e.g. 8)",
        )
    if m.head_dim == 0 and m.hidden_size % m.num_attention_heads:
        fail(
            "model.hidden_size",
            m.hidden_size,
            f"must be divisible by model.num_attention_heads={m.num_attention_heads}",
            "set model.head_dim explicitly or change the sizes",
        )
    if m.num_attention_heads % m.num_query_groups:
        fail(
            "model.num_query_groups",
            m.num_query_groups,
            f"must divide model.num_attention_heads={m.num_attention_heads}",
            "use a divisor of the head count",
        )
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if longest > m.max_position_embeddings:
        fail(
            "data.max_prompt_len + rollout.max_new_tokens",
            longest,
            f"must be <= model.max_position_embeddings={m.max_position_embeddings}",
            "shorten prompts/responses or raise model.max_position_embeddings",
        )


def validate_moe(cfg: TrainConfig, dims: ParallelDims, built: ModelConfig) -> None:
    """The built model's model.moe.* (model.path's config.json's with model.path) and parallel.ep: the
    router, the experts' split over the expert-parallel ranks, and the combinations the MoE path does not run
    (yet)."""
    e = built.moe
    num_experts = f"{model_key(cfg, 'moe.num_experts')}={e.num_experts}"
    if e.num_experts < 0:
        fail("model.moe.num_experts", e.num_experts, "must be >= 0", "use 0 for a dense model")
    if e.num_experts == 0:
        if dims.ep > 1:
            fail(
                "parallel.ep",
                dims.ep,
                f"expert parallelism needs a mixture-of-experts model ({num_experts})",
                "set parallel.ep=1 or pick an MoE model (model=tiny_moe)",
            )
        return
    one_of(model_key(cfg, "moe.score_function"), e.score_function, ("softmax", "sigmoid"))
    one_of(model_key(cfg, "moe.token_dispatcher"), e.token_dispatcher, ("alltoall", "allgather"))
    if not 1 <= e.top_k <= e.num_experts:
        fail(
            model_key(cfg, "moe.top_k"),
            e.top_k,
            f"must be between 1 and {num_experts}",
            "route each token to fewer experts or add experts",
        )
    if e.num_experts % dims.ep:
        fail(
            model_key(cfg, "moe.num_experts"),
            e.num_experts,
            f"must be divisible by parallel.ep={dims.ep} (each expert-parallel rank holds as many experts)",
            "pick a parallel.ep that divides the expert count",
        )
    for field in ("ffn_hidden_size", "shared_expert_ffn_hidden_size", "aux_loss_coef", "z_loss_coef"):
        value = getattr(e, field)
        if value is not None and value < 0:
            key = model_key(cfg, f"moe.{field}")
            fail(key, value, "must be >= 0", f"set model.moe.{field}=0 for the default / off")
    if e.shared_expert_gate and e.shared_expert_ffn_hidden_size == 0:
        fail(
            "model.moe.shared_expert_gate",
            True,
            "gates the shared expert, but model.moe.shared_expert_ffn_hidden_size is 0 (no shared expert)",
            "set model.moe.shared_expert_ffn_hidden_size or shared_expert_gate=false",
        )
    if e.score_function == "sigmoid" and not e.norm_topk_prob:
        fail(
            "model.moe.norm_topk_prob",
            False,
            "megatron's sigmoid router always renormalises the top-k weights",
            "set model.moe.norm_topk_prob=true with score_function=sigmoid",
        )
    if e.score_function == "softmax" and e.top_k == 1 and e.norm_topk_prob:
        fail(
            model_key(cfg, "moe.norm_topk_prob"),
            True,
            "with top_k=1 the renormalised weight is always 1 and the router gets no gradient",
            "set model.moe.norm_topk_prob=false (softmax over all experts, then top-1)",
        )
    if dims.tp > 1 and not dims.sp:
        fail(
            "parallel.sp",
            False,
            f"megatron's MoE layers train at parallel.tp={dims.tp} only with sequence parallelism "
            f"({num_experts})",
            "set parallel.sp=true (or parallel.tp=1)",
        )
    if dims.ep > 1:
        validate_expert_parallel_run(cfg, dims)
    vllm = cfg.rollout.backend == "vllm"
    if (cfg.trainer.export_hf or vllm) and not cfg.model.path:
        validate_moe_hf_type(cfg)
    expert_ffn = e.ffn_hidden_size or built.ffn_hidden_size
    expert_width = model_key(cfg, "moe.ffn_hidden_size")
    if vllm and (expert_ffn % cfg.rollout.tp or e.num_experts < cfg.rollout.tp):
        fail(
            "rollout.tp",
            cfg.rollout.tp,
            f"vLLM's FusedMoE splits each expert's width ({expert_width}={expert_ffn}) over rollout.tp and "
            f"needs at least rollout.tp experts ({num_experts})",
            "pick a rollout.tp that divides the expert width and is <= the expert count, or rollout.backend=native",
        )
    if cfg.placement.mode != "colocated" and dims.ep > 1:
        fail(
            "placement.mode",
            cfg.placement.mode,
            f"split placement trains mixture-of-experts models at parallel.ep=1 only (parallel.ep={dims.ep}: "
            "its weight transfer sends no expert-parallel shards)",
            "set parallel.ep=1 or placement.mode=colocated",
        )


def validate_moe_hf_type(cfg: TrainConfig) -> None:
    """A configured MoE model that trainer.export_hf or vLLM's config.json must write as a Hugging Face
    model type (model.path's already is one)."""
    from engine.models.hf_config import moe_model_type

    m, e = cfg.model, cfg.model.moe
    try:
        moe_model_type(
            m.qkv_bias, m.qk_norm, e.score_function, e.shared_expert_ffn_hidden_size, e.shared_expert_gate
        )
    except ValueError as err:
        key, value, off = (
            ("trainer.export_hf", True, "trainer.export_hf=false")
            if cfg.trainer.export_hf
            else ("rollout.backend", "vllm", "rollout.backend=native")
        )
        fail(
            key,
            value,
            f"the MoE model cannot be written as a Hugging Face checkpoint (nor config.json for vLLM): {err}",
            f"set {off} or change those model keys (model=tiny_moe is Qwen3-MoE-shaped)",
        )


def validate_expert_parallel_run(cfg: TrainConfig, dims: ParallelDims) -> None:
    """parallel.ep > 1 in a training job: the 3D-HybridEngine regroups the dense weights and
    parallel/expert_gather.py sends each rank the experts it lacks (any parallel.pp and rollout.tp); a
    Hugging Face export gathers the experts layer by layer (engine/models/hf_experts.py)."""
    if cfg.rollout.weight_sync != "hybrid":
        fail(
            "rollout.weight_sync",
            cfg.rollout.weight_sync,
            "with parallel.ep > 1 the rollout weights come from the 3D-HybridEngine",
            "set rollout.weight_sync=hybrid",
        )


def validate_tokenizer_source(cfg: TrainConfig) -> None:
    """An empty model.tokenizer_path means model.path's tokenizer (the embedded task included): refuse a
    model.path without one rather than tokenise with something else."""
    from engine.data import TOKENIZER_FILES

    m = cfg.model
    if m.tokenizer_path or not m.path or not os.path.isdir(m.path):
        return
    if not any(os.path.isfile(os.path.join(m.path, name)) for name in TOKENIZER_FILES):
        fail(
            "model.path",
            m.path,
            f"model.tokenizer_path is empty, so the tokenizer is model.path's, but {m.path} has no tokenizer "
            f"files (looked for {', '.join(TOKENIZER_FILES)})",
            f"save the model's tokenizer into {m.path} (tokenizer.save_pretrained), or set "
            "model.tokenizer_path to a directory that has one",
        )


def tokenizer_size(path: str, key: str) -> int | None:
    """The token ids the tokenizer in directory `path` can produce (its largest id + 1), counted on the tokenizer
    as engine/data.py `load_tokenizer` loads it (transformers adds the special tokens that tokenizer_config.json,
    special_tokens_map.json or added_tokens.json name past the vocabulary only when it loads them); None where
    it does not load (the data error names `key` when setup loads it)."""
    from engine.data import DataError, load_tokenizer

    try:
        tokenizer = load_tokenizer(path, key)
    except DataError:
        return None
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def run_tokenizer_size(cfg: TrainConfig) -> tuple[int | None, str]:
    """(`tokenizer_size` of the run's tokenizer, how messages name it): model.tokenizer_path, else model.path's,
    else the embedded character one; None where it does not load or data.train_files has no tokenizer (both
    refused when setup loads the data)."""
    from engine.tasks.embedded import EMBEDDED_VOCAB

    m = cfg.model
    tok_dir = m.tokenizer_path or m.path
    if tok_dir:
        tok_key = "model.tokenizer_path" if m.tokenizer_path else "model.path"
        return tokenizer_size(tok_dir, tok_key), f"{tok_key}={tok_dir!r}"
    if not cfg.data.train_files:
        return len(EMBEDDED_VOCAB), "the embedded character tokenizer (no model.tokenizer_path)"
    return None, "data.train_files without a tokenizer"


def validate_vocab_holds_tokenizer(cfg: TrainConfig, built: ModelConfig) -> None:
    """The actor's vocabulary (model.vocab_size for a random init, 0 = the tokenizer's size; model.path's
    config.json vocab_size) holds every id of the tokenizer (model.tokenizer_path, else model.path's, else the
    embedded character one); otherwise the first rollout's prompts index past the embedding. The tokenizer's
    size is counted on the loaded tokenizer (`tokenizer_size`)."""
    m = cfg.model
    if not m.path and m.vocab_size <= 0:
        return
    key, vocab = model_key(cfg, "vocab_size"), built.vocab_size
    size, source = run_tokenizer_size(cfg)
    if size is None or vocab >= size:
        return
    if not m.path:
        fix = f"set model.vocab_size=0 (the tokenizer's size) or >= {size}, or use a smaller tokenizer"
    elif m.tokenizer_path:
        fix = "point model.tokenizer_path at the tokenizer the checkpoint was trained with (empty: model.path's)"
    else:
        fix = (
            "the checkpoint's config.json and tokenizer files disagree: set model.tokenizer_path to the "
            "tokenizer it was trained with, or save the model and its tokenizer together again"
        )
    fail(
        key,
        vocab,
        f"is smaller than the vocabulary of the tokenizer of {source}: {size} tokens (ids up to {size - 1}), all "
        "of which the model's embedding must hold",
        fix,
    )


def validate_checkpoint_positions(cfg: TrainConfig, key: str, path: str) -> None:
    """The checkpoint directory `path` (set by `key`) holds the longest sequence: its config.json's
    max_position_embeddings >= data.max_prompt_len + rollout.max_new_tokens. Reads the JSON file only."""
    file = os.path.join(path, "config.json")
    fix = f"point {key} at a checkpoint saved with save_pretrained (it writes config.json)"
    if not os.path.isfile(file):
        fail(key, path, f"has no config.json ({file} is missing)", fix)
    try:
        with open(file) as f:
            limit = int(json.load(f)["max_position_embeddings"])
    except KeyError:
        fail(key, path, f"{file} has no max_position_embeddings", fix)
    except (OSError, ValueError, TypeError) as err:
        fail(key, path, f"{file} is not a readable JSON config ({type(err).__name__}: {err})", fix)
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if longest > limit:
        fail(
            "data.max_prompt_len + rollout.max_new_tokens",
            longest,
            f"must be <= max_position_embeddings={limit} of {key}={path!r} ({file})",
            "lower data.max_prompt_len or rollout.max_new_tokens to fit the model's positions",
        )
