"""Tiny randomly initialised Hugging Face models of each supported family, saved to local directories.

Shared by tests/engine/test_hf*.py and the torchrun scripts they launch. No network: configs are built
in code. initializer_range=0.2 makes logits O(1), so a parity tolerance means something.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# 4 layers so that PP=2 x VPP=2 has a layer per chunk; 4 heads / 2 KV heads (GQA) split over TP=2;
# vocab 101 is odd, so TP=2 pads one row.
_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=101,
    max_position_embeddings=128,
    initializer_range=0.2,
)
FAMILIES = ("qwen2", "qwen3", "llama")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _config(family: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    kw = dict(_COMMON)
    if family == "qwen2":  # QKV bias (built in), tied embeddings
        cls, kw["tie_word_embeddings"] = Qwen2Config, True
    elif family == "qwen3":  # QK-norm, head_dim != hidden / heads
        cls, kw["head_dim"] = Qwen3Config, 32
    elif family == "llama":  # untied, Llama-3.1 RoPE scaling
        cls, kw["rope_parameters"], kw["tie_word_embeddings"] = LlamaConfig, LLAMA3_ROPE, False
    elif family == "qwen3_moe":  # QK-norm, 4 experts top-2 renormalised
        cls = Qwen3MoeConfig
        kw.update(_MOE, head_dim=32, norm_topk_prob=True, tie_word_embeddings=False)
    elif family == "qwen2_moe":  # QKV bias, top-2 not renormalised, gated shared expert, tied embeddings
        cls = Qwen2MoeConfig
        kw.update(_MOE, norm_topk_prob=False, shared_expert_intermediate_size=48, tie_word_embeddings=True)
    else:
        raise ValueError(family)
    kw.update(overrides)
    return cls(**kw)


def config_json(**overrides) -> dict:
    """A tiny Qwen2 config.json's keys, as save_pretrained writes those the engine reads (no transformers):
    for tests that need a checkpoint's config.json and no weights."""
    config = {k: v for k, v in _COMMON.items() if k != "initializer_range"}
    config.update(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], rms_norm_eps=1e-6, tie_word_embeddings=True
    )
    return {**config, **overrides}


def save_tiny(family: str, out_dir: str, seed: int = 0, head: str = "causal", **overrides) -> str:
    """Save a random `family` model to `out_dir`; head is `causal`, `token` (num_labels=1: a critic) or
    `sequence` (num_labels=1: a reward model)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    torch.manual_seed(seed)
    config = _config(family, **overrides)
    if head == "token":
        config.num_labels = 1
        model = AutoModelForTokenClassification.from_config(config)
    elif head == "sequence":
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    return out_dir


def make_all(root: str) -> dict[str, str]:
    """Every model the multi-rank script needs, under `root`; returns name -> directory."""
    dirs = {f: save_tiny(f, os.path.join(root, f), seed=i) for i, f in enumerate(FAMILIES + MOE_FAMILIES)}
    dirs["critic"] = save_tiny("qwen2", os.path.join(root, "critic"), seed=7, head="token")
    # 3 layers: PP=2 takes megatron's uneven stages (2 layers, then 1)
    dirs["qwen2_3l"] = save_tiny("qwen2", os.path.join(root, "qwen2_3l"), seed=5, num_hidden_layers=3)
    # big enough to measure loading memory: embedding/lm_head 8 MiB each (vocab odd: padded at TP=2)
    dirs["big"] = save_tiny(
        "llama",
        os.path.join(root, "big"),
        seed=9,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        vocab_size=8191,
        initializer_range=0.02,
    )
    dirs["bad_shape"] = with_config(dirs["llama"], os.path.join(root, "bad_shape"), intermediate_size=128)
    dirs["missing_layer"] = with_config(
        dirs["qwen2"], os.path.join(root, "missing_layer"), num_hidden_layers=6
    )
    return dirs


def with_config(src: str, out_dir: str, **changes) -> str:
    """A copy of checkpoint `src` whose config.json disagrees with its weights (for error tests)."""
    shutil.copytree(src, out_dir)
    file = os.path.join(out_dir, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)
    return out_dir


def hf_reward_scores(model_dir: str, exp) -> torch.Tensor:
    """transformers' float32 score of each row of Experience `exp` (prompt + response, unpadded, one row at a
    time: the pooled logit of a sequence classifier is its last token's)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    lengths = exp.prompt_lens + exp.response_mask.sum(-1).long()
    with torch.no_grad():
        return torch.stack(
            [model(exp.tokens[r : r + 1, : int(lengths[r])]).logits[0, 0] for r in range(len(lengths))]
        )


def exported_experts_match(c, export_dir: str) -> tuple[int, int]:
    """(equal, checked) summed over ranks: every routed expert tensor of the actor of components `c` on each
    rank (global expert ids) vs its tensors in the Hugging Face export at `export_dir` (torch.equal).
    Collective (world)."""
    import torch.distributed as dist

    from engine.models.hf import HFCheckpoint
    from engine.models.hf_map import hf_from_shards, hf_names, local_expert, match_rule
    from parallel.rollout_weights import global_param_names, is_expert_param

    layers = c.groups.dims.train_layout().layers(c.groups.pp_rank, c.shape.num_layers)
    named = global_param_names(c.actor.chunks, layers, c.groups.expert_offset(c.shape.moe.num_experts))
    counts = torch.zeros(2, dtype=torch.int64)
    with HFCheckpoint(export_dir) as ckpt:
        for name, param in named.items():
            if is_expert_param(name):
                rule, layer = match_rule(name)  # a global name: the global layer
                hf = zip(
                    hf_names(rule, layer, local_expert(name)), hf_from_shards(rule, [param.detach()], c.shape)
                )
                for hf_name, tensor in hf:
                    counts += torch.tensor([int(torch.equal(ckpt.tensor(hf_name), tensor)), 1])
    dist.all_reduce(counts)
    return int(counts[0]), int(counts[1])
