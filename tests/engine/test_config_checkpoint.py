"""Architecture keys that model.path's checkpoint replaces (engine/validate/checkpoint.py): a warning for each
configured value that differs from the checkpoint's, none where they agree, and the run built from the
checkpoint's values either way. Tiny random Hugging Face checkpoints saved with save_pretrained (no processes,
no process group); the real-size case reads config.json excerpts only."""

from __future__ import annotations

import json

import hf_tiny
import pytest
from config_compose import composed

from engine.config import ConfigError
from engine.setup import model_shape
from engine.validate.checkpoint import checkpoint_conflict_warnings

FIX = "the checkpoint's value is used; drop the override or fix model.path"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict[str, str]:
    """A dense Qwen2 (4 layers, width 64, vocab 101, tied) and a Qwen3-MoE checkpoint (hf_tiny's sizes)."""
    root = tmp_path_factory.mktemp("hf")
    return {f: hf_tiny.save_tiny(f, str(root / f)) for f in ("qwen2", "qwen3_moe")}


def _warned(path: str, *overrides: str) -> list[str]:
    return checkpoint_conflict_warnings(composed(f"model.path={path}", *overrides))


def test_values_equal_to_the_checkpoints_warn_nothing(ckpt):
    """The default preset (the schema's defaults: no architecture named) and explicit values equal to the
    checkpoint's, MoE included, give no warning."""
    assert _warned(ckpt["qwen2"]) == []
    same = ["model.num_layers=4", "model.hidden_size=64", "model.ffn_hidden_size=96", "model.vocab_size=101"]
    assert _warned(ckpt["qwen2"], *same, "model.qkv_bias=true", "model.tie_embeddings=true") == []
    assert _warned(ckpt["qwen3_moe"], "model=tiny_moe", "model.moe.ffn_hidden_size=32") == []
    assert checkpoint_conflict_warnings(composed()) == []  # no model.path


@pytest.mark.parametrize("preset", ["qwen2_5_0_5b", "qwen3_30b_a3b"])
def test_a_preset_equal_to_its_real_config_warns_nothing(preset, tmp_path):
    """The common case: a preset with model.path at the checkpoint it describes (real config.json values)."""
    from test_hf import REAL_CONFIGS

    (tmp_path / "config.json").write_text(json.dumps(REAL_CONFIGS[preset]))
    assert _warned(str(tmp_path), f"model={preset}") == []


def test_a_wrong_preset_warns_once_per_differing_key_and_the_checkpoint_is_built(ckpt):
    """model=qwen2_5_1_5b on a 4-layer, width-64 Qwen2: one line per key that differs, naming both values, the
    config.json and the fix; keys that agree (GQA groups, QKV bias, tied embeddings, norm eps) and keys
    config.json does not hold (dtype) give none. The shape is the checkpoint's."""
    path = ckpt["qwen2"]
    cfg = composed("model=qwen2_5_1_5b", f"model.path={path}")
    lines = checkpoint_conflict_warnings(cfg)
    file = f"{path}/config.json"
    for key, ours, theirs in [
        ("hidden_size", 1536, 64),
        ("num_layers", 28, 4),
        ("vocab_size", 151936, 101),
        ("ffn_hidden_size", 8960, 96),
        ("num_attention_heads", 12, 4),
        ("head_dim", 128, 16),
        ("max_position_embeddings", 131072, 128),
        ("rope_theta", 1000000.0, 10000.0),
    ]:
        assert f"warning: model.{key}={ours!r} differs from {file} ({theirs!r}): {FIX}" in lines
    assert len(lines) == 8
    shape = model_shape(cfg.model, tokenizer_vocab=99, tp=1)
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size, shape.head_dim) == (4, 64, 101, 16)
    assert shape.max_position_embeddings == 128 and shape.rope_theta == 10000.0


def test_command_line_overrides_that_differ_are_named(ckpt):
    lines = _warned(ckpt["qwen2"], "model.hidden_size=128", "model.num_layers=8", "model.vocab_size=200")
    file = f"{ckpt['qwen2']}/config.json"
    assert lines == [
        f"warning: model.num_layers=8 differs from {file} (4): {FIX}",
        f"warning: model.hidden_size=128 differs from {file} (64): {FIX}",
        f"warning: model.vocab_size=200 differs from {file} (101): {FIX}",
    ]


def test_moe_keys_against_moe_and_dense_checkpoints(ckpt):
    """An MoE checkpoint replaces the experts' architecture but keeps the config's MoE training settings
    (z-loss, token dispatcher: config.json holds neither); a dense checkpoint reads only num_experts."""
    moe = ckpt["qwen3_moe"]
    cfg = composed(
        "model=tiny_moe",
        f"model.path={moe}",
        "model.moe.num_experts=8",
        "model.moe.ffn_hidden_size=32",
        "model.moe.z_loss_coef=0.01",
        "model.moe.token_dispatcher=allgather",
    )
    assert checkpoint_conflict_warnings(cfg) == [
        f"warning: model.moe.num_experts=8 differs from {moe}/config.json (4): {FIX}"
    ]
    shape = model_shape(cfg.model, tokenizer_vocab=99, tp=1)
    assert (shape.moe.num_experts, shape.moe.ffn_hidden_size) == (4, 32)
    assert (shape.moe.z_loss_coef, shape.moe.token_dispatcher) == (0.01, "allgather")
    dense = ckpt["qwen2"]
    assert _warned(dense, "model=tiny_moe", "model.qkv_bias=true", "model.qk_norm=false") == [
        f"warning: model.moe.num_experts=4 differs from {dense}/config.json (0): {FIX}"
    ]


def test_moe_aux_loss_coef_is_the_checkpoints_unless_set(ckpt):
    """model.moe.aux_loss_coef unset: model.path's router_aux_loss_coef (as verl reads it; hf_tiny's Qwen3-MoE
    has transformers' default, 0.001); set: that value, 0 included (RL runs turn the load-balancing loss off on
    a checkpoint trained with it), and no warning either way. Without model.path, unset is 0."""
    moe = ckpt["qwen3_moe"]
    with open(f"{moe}/config.json") as f:
        saved = json.load(f)["router_aux_loss_coef"]
    assert saved > 0
    for overrides, expected in (
        ((), saved),
        (("model.moe.aux_loss_coef=0",), 0.0),
        (("model.moe.aux_loss_coef=0.02",), 0.02),
    ):
        cfg = composed(f"model.path={moe}", *overrides)
        assert checkpoint_conflict_warnings(cfg) == []
        assert model_shape(cfg.model, tokenizer_vocab=99, tp=1).moe.aux_loss_coef == expected, overrides
    unset = composed("model=tiny_moe", "model.moe.aux_loss_coef=null")
    assert model_shape(unset.model, tokenizer_vocab=99, tp=1).moe.aux_loss_coef == 0.0


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    """The embedded character tokenizer (50 tokens) saved as files: the tiny checkpoints have none."""
    from engine.tasks.embedded import build_embedded_tokenizer

    return build_embedded_tokenizer(str(tmp_path_factory.mktemp("tok") / "tok"))


def _validated(path: str, tok: str, *overrides: str, world_size: int = 1):
    from engine.validate import validate

    return validate(composed(f"model.path={path}", f"model.tokenizer_path={tok}", *overrides), world_size)


def test_validation_applies_the_moe_rules_to_an_moe_checkpoint(ckpt, tok):
    """model=tiny (dense) with model.path at a Qwen3-MoE checkpoint builds an MoE model, so validation
    applies the MoE rules to the checkpoint's experts (4, each 32 wide) and names the config.json key they
    come from."""
    moe = ckpt["qwen3_moe"]
    file = f"model.path's {moe}/config.json"
    _validated(moe, tok)
    _validated(moe, tok, "parallel.tp=2", "parallel.sp=true", world_size=2)
    _validated(moe, tok, "algorithm.router_replay=true")  # replays the checkpoint's experts
    with pytest.raises(ConfigError, match=r"model.moe.aux_loss_coef=-1.0: must be >= 0"):  # set: its own key
        _validated(moe, tok, "model.moe.aux_loss_coef=-1")
    with pytest.raises(
        ConfigError, match="parallel.sp=False: megatron's MoE layers train at parallel.tp=2"
    ) as err:
        _validated(moe, tok, "parallel.tp=2", world_size=2)
    assert f"({file}: num_experts=4). Fix: set parallel.sp=true" in str(err.value)

    from engine.validate.model import validate_model, validate_parallel

    def vllm(*overrides: str) -> None:  # the model checks only: vLLM needs a GPU and its package
        cfg = composed(f"model.path={moe}", f"model.tokenizer_path={tok}", "rollout.backend=vllm", *overrides)
        validate_model(cfg, validate_parallel(cfg, 1))

    vllm("rollout.tp=2")
    with pytest.raises(
        ConfigError, match=f"rollout.tp=8: .*needs at least rollout.tp experts \\({file}: num_exp"
    ):
        vllm("rollout.tp=8")
    with pytest.raises(
        ConfigError, match=f"rollout.tp=3: .*expert's width \\({file}: moe_intermediate_size=32\\)"
    ):
        vllm("rollout.tp=3")


def test_validation_splits_a_dense_checkpoints_heads_by_parallel_tp(ckpt, tok):
    """The checkpoint's heads (4, 2 KV heads), not model=tiny's, are checked against parallel.tp before any
    process group exists; its dense layers refuse expert routing replay, naming config.json."""
    dense = ckpt["qwen2"]
    file = f"model.path's {dense}/config.json"
    assert _validated(dense, tok, "parallel.tp=2", world_size=2).tp == 2
    with pytest.raises(
        ConfigError, match=f"{file}: num_key_value_heads=2: must be divisible by parallel.tp=4"
    ):
        _validated(dense, tok, "parallel.tp=4", world_size=4)
    with pytest.raises(ConfigError, match=f"router_replay=True: .*{file}: num_experts=0 \\(a dense model\\)"):
        _validated(dense, tok, "algorithm.router_replay=true")


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_a_half_precision_checkpoint_trained_in_float32_on_cuda_is_warned(key, tmp_path):
    """The README's `task=gsm8k model.path=DIR` keeps the default preset's float32: on a CUDA cluster a
    bfloat16 checkpoint (transformers 5's "dtype" or the older "torch_dtype") gets one warning naming the fix;
    model.dtype=bfloat16, the CPU cluster, or a float32 checkpoint get none. Validation only: no GPU needed."""
    from test_hf import REAL_CONFIGS

    config = {k: v for k, v in REAL_CONFIGS["qwen2_5_0_5b"].items() if k not in ("dtype", "torch_dtype")}
    (tmp_path / "config.json").write_text(json.dumps({**config, key: "bfloat16"}))
    path = str(tmp_path)
    lines = _warned(path, "cluster=single_gpu")
    assert len(lines) == 1 and "model.dtype=float32 trains" in lines[0], lines
    assert "set model.dtype=bfloat16" in lines[0] and f"{path}/config.json" in lines[0]
    assert _warned(path, "cluster=single_gpu", "model.dtype=bfloat16") == []
    assert _warned(path) == []  # the CPU cluster
    (tmp_path / "config.json").write_text(json.dumps({**config, key: "float32"}))
    assert _warned(path, "cluster=single_gpu") == []


def test_critic_and_reward_checkpoints_are_checked_at_the_actors_layout(tmp_path):
    """critic.path and reward.model_path are built at the actor's layout with their own architecture: heads
    that parallel.tp does not divide, or a vocabulary smaller than the run's tokenizer (the embedded one: 50
    ids), are refused at validation naming the checkpoint's config.json key (they failed inside megatron, or at
    setup, after the process groups existed). A checkpoint that fits passes; the actor is the tiny preset."""
    from engine.validate import validate

    def config_dir(name: str, **overrides) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(hf_tiny.config_json(**overrides)))
        return str(path)

    three_heads = config_dir("three_heads", hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    small_vocab = config_dir("small_vocab", vocab_size=40)
    fits = config_dir("fits")
    tp2 = ("parallel.tp=2", "parallel.sp=true")
    validate(composed("algorithm=ppo", f"critic.path={fits}", *tp2), world_size=2)
    with pytest.raises(ConfigError) as err:
        validate(composed("algorithm=ppo", f"critic.path={three_heads}", *tp2), world_size=2)
    assert (
        f"critic.path's {three_heads}/config.json: num_attention_heads=3: must be divisible by parallel.tp=2"
        in str(err.value)
    )
    with pytest.raises(
        ConfigError, match=r"small_vocab/config.json: vocab_size=40: is smaller than the vocabulary"
    ):
        validate(composed("algorithm=ppo", f"critic.path={small_vocab}"), world_size=1)
    validate(composed(f"critic.path={three_heads}", *tp2), world_size=2)  # GRPO builds no critic
    reward = hf_tiny.save_tiny(
        "qwen2",
        str(tmp_path / "reward"),
        head="sequence",
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=1,
    )
    with pytest.raises(ConfigError, match=r"reward.model_path's .*reward/config.json: num_attention_heads=3"):
        validate(composed(f"reward.model_path={reward}", *tp2), world_size=2)
