"""HF checkpoints <-> Megatron TP/PP shards (engine/models/hf*.py, engine/tools/parity.py).

World sizes: every test here runs in the pytest process without a process group (world size 1, megatron
untouched) except `test_world4_parity_round_trip_memory_errors`, which launches tests/engine/hf_multirank.py
once on 4 gloo ranks and checks everything that needs real shards there.
Tolerance: float32 logits within 5e-5 of transformers (measured <= 1e-5; 0 at TP=1).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import hf_tiny
import pytest
import torch
from distributed import run_torchrun
from safetensors.torch import save_file

from engine.config import ModelConfig, TrainConfig, register_configs
from engine.config_load import to_dataclass
from engine.models.builder import ValueHead, resolve_shape
from engine.models.hf import HFCheckpoint, load_hf_weights
from engine.models.hf_config import HFCheckpointError, model_config_from_hf
from engine.models.hf_map import (
    WEIGHT_MAP,
    Split,
    hf_from_shards,
    hf_names,
    hf_pieces_of_shard,
    local_expert,
    match_rule,
    shard_from_hf,
)
from engine.tools.parity import hf_model_shape
from engine.tools.parity import main as parity_main
from parallel.dims import ParallelDims

SCRIPT = str(Path(__file__).with_name("hf_multirank.py"))
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
TOL = 5e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    return hf_tiny.make_all(str(tmp_path_factory.mktemp("hf")))


# --- world size 4: parity, round trip, memory, errors with real shards (one launch) ---


@pytest.mark.slow
def test_world4_parity_round_trip_memory_errors(tiny):
    out = run_torchrun(SCRIPT, 4, [os.path.dirname(tiny["qwen2"])])
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT {" in line]
    layouts = [r for r in results if r["kind"] == "layout"]
    # 5 families (2 of them MoE) x (TP, PP, VPP) in {(1,1,1), (2,1,1), (1,2,1), (2,2,1), (1,2,2)}
    assert {(r["family"], r["tp"], r["pp"], r["vpp"]) for r in layouts} == {
        (f, *layout)
        for f in hf_tiny.FAMILIES + hf_tiny.MOE_FAMILIES
        for layout in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2))
    }
    moe_ep = [r for r in results if r["kind"] == "moe_ep"]
    assert {(r["family"], r["tp"], r["pp"], r["ep"]) for r in moe_ep} == {
        (f, *layout)
        for f in hf_tiny.MOE_FAMILIES
        for layout in ((1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 2))
    }
    assert all(r["ok"] and r["max_abs_logit_diff"] <= TOL for r in moe_ep), moe_ep
    # exported at every EP layout (experts gathered over EP ranks and DP replicas): the EP=1 export's bytes
    assert all(r["same_files_as_ep1"] for r in moe_ep), moe_ep
    for r in layouts:
        assert r["ok"] and r["max_abs_logit_diff"] <= TOL, r
        assert r["tensors"] > 0, r  # every saved tensor torch.equal to the original (checked in the script)
    assert any(r["saved_sharded"] for r in layouts) and not all(r["saved_sharded"] for r in layouts)
    (critic,) = [r for r in results if r["kind"] == "critic"]
    assert critic["max_abs_value_diff"] <= TOL
    assert [r for r in results if r["kind"] == "critic_fresh_head_zero"]
    assert [r for r in results if r["kind"] == "bf16_round_trip"]
    (memory,) = [r for r in results if r["kind"] == "memory"]
    # loading at TP=2 creates no tensor larger than 1/8 of a shard (measured: none at all), while a
    # materialised full tensor is visible to the same instrument
    assert max(memory["largest_new_tensor_bytes_per_rank"]) <= memory["bound_bytes"]
    assert memory["naive_full_clone_bytes"] >= memory["biggest_full_tensor_bytes"] > memory["bound_bytes"]
    assert {r["case"] for r in results if r["kind"] == "error"} == {"bad_shape", "missing_layer"}
    (uneven,) = [r for r in results if r["kind"] == "uneven"]  # 3 layers at PP=2: stages of 2 and 1
    assert uneven["ok"] and uneven["max_abs_logit_diff"] <= TOL and uneven["tensors"] > 0, uneven
    (cli,) = [json.loads(line[line.index("{") :]) for line in out.splitlines() if '{"model": ' in line]
    assert cli["ok"] and cli["tp"] == 2 and cli["pp"] == 2 and cli["model"].endswith("qwen2_3l"), cli


# --- the weight map: pure tensor math, no processes ---


def _shape(tp: int):
    """8 heads in 4 query groups of head_dim 3, vocab 11 (padded at TP 2 and 4)."""
    m = ModelConfig(
        num_layers=2, hidden_size=8, ffn_hidden_size=12, num_attention_heads=8, num_query_groups=4, head_dim=3
    )
    return resolve_shape(m, 11, tp)


def _megatron_reference(rule, full, shape, tp, rank):
    """Megatron's layout written out directly, independently of hf_map."""
    if rule.split is Split.QKV:
        q, k, v = full
        per_group = shape.num_attention_heads // shape.num_query_groups * shape.head_dim
        groups = range(rank * shape.num_query_groups // tp, (rank + 1) * shape.num_query_groups // tp)
        d = shape.head_dim
        return torch.cat(
            [
                torch.cat(
                    [q[g * per_group : (g + 1) * per_group], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
                )
                for g in groups
            ]
        )
    if rule.split is Split.GATE_UP:
        return torch.cat([t.chunk(tp)[rank] for t in full])
    if rule.split is Split.ROW:
        return full[0].chunk(tp, dim=1)[rank]
    if rule.split is Split.VOCAB:
        padded = torch.cat(
            [full[0], full[0].new_zeros(shape.padded_vocab_size - shape.vocab_size, *full[0].shape[1:])]
        )
        return padded.chunk(tp)[rank]
    return full[0]


def _hf_shapes(rule, shape):
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    bias = rule.megatron.endswith("bias")
    if rule.split is Split.QKV:
        return [(q,), (kv,), (kv,)] if bias else [(q, h), (kv, h), (kv, h)]
    if rule.split is Split.GATE_UP:
        return [(f, h), (f, h)]
    if rule.split is Split.VOCAB:
        return [(shape.vocab_size, h)]
    if "linear_proj" in rule.megatron:
        return [(h, q)]
    if "linear_fc2" in rule.megatron:
        return [(h, f)]
    if "q_layernorm" in rule.megatron or "k_layernorm" in rule.megatron:
        return [(d,)]
    return [(h,)]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("rule", WEIGHT_MAP, ids=lambda r: r.megatron)
def test_weight_map_shards_match_megatron_layout_and_invert(rule, tp):
    shape = _shape(tp=tp)
    full = [torch.randn(s) for s in _hf_shapes(rule, shape)]
    shards = []
    for rank in range(tp):
        want = _megatron_reference(rule, full, shape, tp, rank)
        out = torch.full_like(want, float("nan"))
        shard_from_hf(rule, lambda i, index: full[i][index], out, shape, tp, rank)
        assert torch.equal(out, want), (rule.megatron, tp, rank)
        pieces = hf_pieces_of_shard(rule, out, shape, tp)
        assert len(pieces) == len(rule.hf)
        shards.append(out)
    back = hf_from_shards(rule, shards, shape)
    assert all(torch.equal(a, b) for a, b in zip(back, full))


def test_match_rule_gives_local_layer_and_names_unknown_parameters():
    rule, layer = match_rule("decoder.layers.3.mlp.linear_fc1.weight")
    assert rule.split is Split.GATE_UP and layer == 3
    assert match_rule("decoder.final_layernorm.weight")[1] is None
    with pytest.raises(KeyError, match="decoder.layers.0.mlp.routers.weight"):
        match_rule("decoder.layers.0.mlp.routers.weight")


def test_moe_rules_name_global_experts_and_stay_whole_per_tp_rank():
    """A routed expert's Megatron name carries its local index; its HF names take the global one (local +
    ep_rank * local experts). Expert weights are never TP-split; the router and shared expert map too."""
    name = "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"
    rule, layer = match_rule(name)
    assert rule.expert and rule.split is Split.GATE_UP and layer == 2 and local_expert(name) == 1
    assert hf_names(rule, 5, 1 + 2 * 4) == (
        "model.layers.5.mlp.experts.9.gate_proj.weight",
        "model.layers.5.mlp.experts.9.up_proj.weight",
    )
    fc2, _ = match_rule("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight")
    assert fc2.expert and hf_names(fc2, 0, 3) == ("model.layers.0.mlp.experts.3.down_proj.weight",)
    assert hf_names(match_rule("decoder.layers.0.mlp.router.weight")[0], 0) == (
        "model.layers.0.mlp.gate.weight",
    )
    gate, _ = match_rule("decoder.layers.0.mlp.shared_experts.gate_weight")
    assert hf_names(gate, 0) == ("model.layers.0.mlp.shared_expert_gate.weight",)
    shared, _ = match_rule("decoder.layers.0.mlp.shared_experts.linear_fc1.weight")
    assert not shared.expert and shared.split is Split.GATE_UP


def test_moe_export_config_refuses_what_no_family_computes():
    from engine.models.builder import MoEShape
    from engine.models.hf_config import hf_config_from_shape

    base = resolve_shape(ModelConfig(qk_norm=True), 11, 1)
    moe = MoEShape(num_experts=4, top_k=2, ffn_hidden_size=8)
    cfg = hf_config_from_shape(replace(base, moe=moe))
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 4
    with pytest.raises(ValueError, match="sigmoid router"):
        hf_config_from_shape(replace(base, moe=replace(moe, score_function="sigmoid")))
    with pytest.raises(ValueError, match="Qwen2-MoE"):
        hf_config_from_shape(replace(base, moe=replace(moe, shared_ffn_hidden_size=8)))


# --- config.json -> ModelConfig overrides ---


def test_model_config_from_hf_families(tiny):
    qwen2, qwen3, llama = (model_config_from_hf(tiny[f]) for f in ("qwen2", "qwen3", "llama"))
    common = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2)
    for o in (qwen2, qwen3, llama):
        assert {k: o[k] for k in common} == common and o["vocab_size"] == 101
    assert (qwen2["qkv_bias"], qwen2["qk_norm"], qwen2["tie_embeddings"], qwen2["head_dim"]) == (
        True,
        False,
        True,
        16,
    )
    assert (qwen3["qkv_bias"], qwen3["qk_norm"], qwen3["tie_embeddings"], qwen3["head_dim"]) == (
        False,
        True,
        False,
        32,
    )
    assert (llama["qkv_bias"], llama["qk_norm"], llama["tie_embeddings"]) == (False, False, False)
    assert (llama["rope_theta"], llama["rope_scaling_factor"], qwen2["rope_scaling_factor"]) == (
        500000.0,
        8.0,
        0.0,
    )
    assert set(qwen2) <= set(ModelConfig.__dataclass_fields__)
    assert qwen2["moe"].num_experts == 0  # dense families resolve to no experts


def test_model_config_from_hf_moe_families(tiny):
    qwen3_moe, qwen2_moe = (model_config_from_hf(tiny[f]) for f in hf_tiny.MOE_FAMILIES)
    for o in (qwen3_moe, qwen2_moe):
        assert (o["moe"].num_experts, o["moe"].top_k, o["moe"].ffn_hidden_size) == (4, 2, 32)
        assert o["moe"].score_function == "softmax"
    assert qwen3_moe["qk_norm"] and not qwen3_moe["qkv_bias"] and qwen3_moe["moe"].norm_topk_prob
    assert qwen3_moe["moe"].shared_expert_ffn_hidden_size == 0
    assert qwen2_moe["qkv_bias"] and not qwen2_moe["moe"].norm_topk_prob
    assert (qwen2_moe["moe"].shared_expert_ffn_hidden_size, qwen2_moe["moe"].shared_expert_gate) == (48, True)


def _write_config(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


# Excerpts of the real config.json files (transformers 4.x layout: top-level rope_theta / rope_scaling).
REAL_CONFIGS = {
    "qwen2_5_0_5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-06, tie_word_embeddings=True,
        hidden_act="silu", use_sliding_window=False, sliding_window=32768, rope_scaling=None,
    ),
    "qwen2_5_1_5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-06, tie_word_embeddings=True,
        hidden_act="silu", use_sliding_window=False, rope_scaling=None,
    ),
    "qwen2_5_7b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-06, tie_word_embeddings=False,
        hidden_act="silu", use_sliding_window=False, rope_scaling=None,
    ),
    "qwen3_0_6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000, rms_norm_eps=1e-06, tie_word_embeddings=True,
        hidden_act="silu", attention_bias=False, use_sliding_window=False, rope_scaling=None,
    ),
    "llama3_8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-05, tie_word_embeddings=False,
        hidden_act="silu", attention_bias=False, mlp_bias=False, rope_scaling=None,
    ),
    "qwen3_30b_a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-06, tie_word_embeddings=False,
        hidden_act="silu", attention_bias=False, use_sliding_window=False, rope_scaling=None,
        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768, norm_topk_prob=True,
        num_experts=128, num_experts_per_tok=8, router_aux_loss_coef=0.001,
    ),
    "qwen1_5_moe_a2_7b": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
        max_position_embeddings=8192, rope_theta=1000000.0, rms_norm_eps=1e-06, tie_word_embeddings=False,
        hidden_act="silu", use_sliding_window=False, decoder_sparse_step=1, moe_intermediate_size=1408,
        norm_topk_prob=False, num_experts=60, num_experts_per_tok=4, shared_expert_intermediate_size=5632,
        router_aux_loss_coef=0.001,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_preset_composes_into_model_config_and_matches_real_config(name, tmp_path):
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("train", overrides=[f"model={name}"])
    model = to_dataclass(cfg).model
    assert isinstance(to_dataclass(cfg), TrainConfig) and model.name == name and model.dtype == "bfloat16"
    overrides = model_config_from_hf(_write_config(tmp_path, REAL_CONFIGS[name]))
    assert {k: getattr(model, k) for k in overrides} == overrides


def test_llama31_rope_scaling_in_transformers4_layout(tmp_path):
    config = dict(REAL_CONFIGS["llama3_8b"], max_position_embeddings=131072)
    config["rope_scaling"] = {k: v for k, v in hf_tiny.LLAMA3_ROPE.items() if k != "rope_theta"}
    assert model_config_from_hf(_write_config(tmp_path, config))["rope_scaling_factor"] == 8.0
    # both layouts: rope_scaling's keys win over rope_parameters', as in transformers; theta stays
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    read = model_config_from_hf(_write_config(tmp_path, config))
    assert (read["rope_scaling_factor"], read["rope_theta"]) == (8.0, 500000.0)


# --- bad input: each message names the thing and the fix ---


@pytest.mark.parametrize(
    "change, needles",
    [
        (dict(model_type="mistral", architectures=["MistralForCausalLM"]), ["'mistral'", "MistralForCausalLM", "qwen2, qwen3, llama"]),
        (dict(architectures=["LlamaForQuestionAnswering"]), ["LlamaForQuestionAnswering", "LlamaForCausalLM"]),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["rope_type='yarn'", "llama3"]),
        # a transformers-5 config (rope_parameters) with the model cards' long-context edit: it was read as default RoPE
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_scaling={"type": "yarn", "factor": 4.0}), ["rope_type='yarn'"]),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_scaling={"type": "linear", "factor": 2.0}), ["rope_type='linear'"]),
        (dict(rope_scaling=dict(hf_tiny.LLAMA3_ROPE, high_freq_factor=2.0)), ["high_freq_factor", "2.0"]),
        (dict(rope_theta=10000.5), ["rope_theta", "10000.5"]),
        (dict(hidden_act="gelu"), ["hidden_act='gelu'"]),
        (dict(attention_bias=True), ["attention_bias=True"]),
        (dict(num_hidden_layers=None, n_layer=3), ["num_hidden_layers"]),
    ],
)  # fmt: skip
def test_unsupported_configs_name_the_key(change, needles, tmp_path):
    config = dict(REAL_CONFIGS["llama3_8b"], **change)
    if config.get("num_hidden_layers") is None:
        del config["num_hidden_layers"]
    with pytest.raises(HFCheckpointError) as err:
        model_config_from_hf(_write_config(tmp_path, config))
    assert str(tmp_path / "config.json") in str(err.value)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_sliding_window_is_refused(tmp_path):
    config = dict(REAL_CONFIGS["qwen2_5_0_5b"], use_sliding_window=True)
    with pytest.raises(HFCheckpointError, match="use_sliding_window"):
        model_config_from_hf(_write_config(tmp_path, config))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(HFCheckpointError, match="is not a directory"):
        model_config_from_hf(str(tmp_path / "nope"))
    with pytest.raises(HFCheckpointError, match=r"config\.json is missing"):
        model_config_from_hf(str(tmp_path))


def test_missing_weight_files_are_named(tiny, tmp_path):
    empty = _write_config(tmp_path, REAL_CONFIGS["llama3_8b"])
    with pytest.raises(
        HFCheckpointError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"
    ):
        HFCheckpoint(empty)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": torch.zeros(2)}, str(sharded / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with HFCheckpoint(str(sharded)) as ckpt:
        assert torch.equal(ckpt.tensor("a"), torch.zeros(2))
        with pytest.raises(HFCheckpointError, match="model-00002-of-00002.safetensors is missing.*'b'"):
            ckpt.tensor("b")
        with pytest.raises(
            HFCheckpointError, match=r"tensor 'c' is missing from .*model\.safetensors\.index\.json"
        ):
            ckpt.tensor("c")


def test_query_groups_not_divisible_by_tp(tiny):
    with pytest.raises(HFCheckpointError) as err:
        hf_model_shape(tiny["qwen2"], 4)
    for needle in ("num_key_value_heads", "=2", "parallel.tp=4", "[1, 2]", "config.json"):
        assert needle in str(err.value), needle


def test_parity_cli_needs_model_path():
    with pytest.raises(SystemExit, match="model.path"):
        parity_main([])


# --- the critic's value head (no megatron needed: the head is a plain module) ---


def _critic_chunk(shape):
    chunk = torch.nn.Module()
    chunk.output_layer = ValueHead(shape.hidden_size, torch.float32, sequence_parallel=False)
    return chunk


def test_value_head_loads_score_weight_and_refuses_a_nonzero_bias(tiny, tmp_path):
    groups = SimpleNamespace(dims=ParallelDims(1), tp_rank=0)
    shape = hf_model_shape(tiny["critic"], 1)
    chunk = _critic_chunk(shape)
    load_hf_weights([chunk], tiny["critic"], shape, groups)
    with HFCheckpoint(tiny["critic"]) as ckpt:
        assert torch.equal(chunk.output_layer.weight, ckpt.tensor("score.weight"))
        tensors = {n: ckpt.tensor(n).clone() for n in ckpt.file_of}
    fresh = _critic_chunk(shape)
    load_hf_weights([fresh], tiny["qwen2"], shape, groups)  # a causal LM has no score.weight
    assert not fresh.output_layer.weight.any()

    biased = hf_tiny.with_config(tiny["critic"], str(tmp_path / "biased"))
    save_file({**tensors, "score.bias": torch.ones(1)}, os.path.join(biased, "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"'score.bias' in .*biased/model\.safetensors is nonzero"):
        load_hf_weights([_critic_chunk(shape)], biased, shape, groups)
