"""scripts/bench/trl_grpo.py without TRL or a GPU: its length plumbing. The row-cap logits processor inside a
real transformers `generate` (a tiny random Qwen2, left-padded prompts, sampling: what TRL's generate path
calls), and the per-prompt vLLM SamplingParams builder on a stand-in for vLLM's class (vLLM is not installed
on CPU). World size: none."""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))

from trl_grpo import bench_prompts, cap_lookup, per_prompt_sampling, with_row_caps  # noqa: E402
from workload import response_lengths  # noqa: E402

from engine.data import load_tokenizer  # noqa: E402
from engine.tasks.embedded import build_embedded_tokenizer  # noqa: E402

MAX_LEN = 12


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = load_tokenizer(build_embedded_tokenizer(str(tmp_path_factory.mktemp("tok"))))
    tok.padding_side = "left"
    return tok


def test_generate_with_row_caps_ends_each_row_at_its_cap(tokenizer):
    """Each completion is cap tokens without EOS, then EOS (a row capped at the limit: MAX_LEN tokens, no
    EOS), whatever the prompt's padding; the caps come from the workload's draw, looked up by prompt."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(config).eval()
    prompts = bench_prompts(6, 9, seed=1)
    assert len(set(prompts)) == 6 and bench_prompts(6, 9, seed=1) == prompts
    prompts[1] = prompts[1][:4]  # different lengths: left padding inside the batch
    caps = [3, 1, MAX_LEN, 7, 2, 5]
    generate = with_row_caps(model.generate, cap_lookup(tokenizer, prompts, caps), tokenizer.eos_token_id)
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    # EOS made likely everywhere: without the processor rows would stop early
    model.lm_head.bias = None
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] += 2.0
    out = generate(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        do_sample=True,
        max_new_tokens=MAX_LEN,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    completions = out[:, batch["input_ids"].shape[1] :].tolist()
    eos = tokenizer.eos_token_id
    for row, cap in zip(completions, caps):
        assert eos not in row[:cap], (row, cap)
        if cap < MAX_LEN:
            assert row[cap] == eos, (row, cap)
    with pytest.raises(KeyError, match="no response cap for prompt '999'"):
        cap_lookup(tokenizer, prompts, caps)(tokenizer("999", add_special_tokens=False)["input_ids"])


@dataclass
class SamplingParams:
    """Stand-in for vLLM's SamplingParams: the fields the builder touches, and `clone`."""

    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    temperature: float = 1.0

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)


def test_per_prompt_sampling_params_take_each_prompts_cap(tokenizer):
    prompts = bench_prompts(8, 16, seed=3)
    caps = response_lengths("long_tail", 8, 64, seed=3)
    cap_of = cap_lookup(tokenizer, prompts, caps)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    requests = [{"prompt_token_ids": ids[i]} for i in (2, 2, 5, 0)]  # TRL repeats a prompt n times
    base = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.7)
    params = per_prompt_sampling(requests, base, cap_of)
    assert [p.max_tokens for p in params] == [caps[2], caps[2], caps[5], caps[0]]
    assert [p.min_tokens for p in params] == [p.max_tokens for p in params]
    assert all(p.ignore_eos and p.temperature == 0.7 for p in params)
    assert base == SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.7)  # untouched
