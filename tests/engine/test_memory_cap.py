"""The memory cap on the trainer's default micro-batches (engine/roles/memory_cap.py, engine/roles/dynamic_batch.py).

The activation count against hand-computed values at the Qwen2.5 shapes and against what one H200 measured
(peak memory of one 32,256-token micro-batch less the model's states: 0.5B ~42 KB per token and layer, 1.5B
~71 KB; scripts/bench/README.md), within 10%; the cap's arithmetic; the micro-batcher under a cap (packed rows
grouped within it, padded micro-batches with fewer rows; a user's budget and the interleaved schedule's rows
untouched); on the CPU the host's memory, split among its ranks; no cap with a budget.
"""

from __future__ import annotations

import types

import pytest
import torch
from trainer_parity import skewed_experience

from engine.config import ModelConfig, MoEConfig
from engine.models.builder import ModelShape, resolve_shape
from engine.roles import memory_cap
from engine.roles.dynamic_batch import MicroBatcher
from parallel.dims import ParallelDims


def _qwen(hidden, ffn, layers, heads, groups, head_dim, moe=None) -> ModelShape:
    cfg = ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        dtype="bfloat16",
        moe=moe or MoEConfig(),
    )
    return resolve_shape(cfg, 151936, 1)


QWEN_0_5B = _qwen(896, 4864, 24, 14, 2, 64)
QWEN_1_5B = _qwen(1536, 8960, 28, 12, 2, 128)


def test_activation_bytes_hand_computed_and_near_the_measured():
    one = ParallelDims(world_size=1)
    # per layer: 4 x hidden (norms) + (2 x 14 + 2 x 2) x 64 (q, k, v, attention out) + 3 x 4864 (SwiGLU), bf16
    assert memory_cap.activation_bytes_per_token(QWEN_0_5B, one, False) == 24 * 2 * (
        4 * 896 + 32 * 64 + 3 * 4864
    )
    assert memory_cap.activation_bytes_per_token(QWEN_1_5B, one, False) == 28 * 2 * (
        4 * 1536 + 28 * 128 + 3 * 8960
    )
    for shape, measured in ((QWEN_0_5B, 42e3), (QWEN_1_5B, 71e3)):
        per_layer = memory_cap.activation_bytes_per_token(shape, one, False) / shape.num_layers
        assert abs(per_layer - measured) <= 0.1 * measured


def test_activation_bytes_under_tensor_parallelism_recompute_and_moe():
    full = memory_cap.activation_bytes_per_token(QWEN_1_5B, ParallelDims(world_size=1), False)
    tp2 = memory_cap.activation_bytes_per_token(QWEN_1_5B, ParallelDims(world_size=2, tp=2), False)
    sp2 = memory_cap.activation_bytes_per_token(QWEN_1_5B, ParallelDims(world_size=2, tp=2, sp=True), False)
    assert tp2 == 28 * 2 * (4 * 1536 + (28 * 128 + 3 * 8960) // 2)  # the norms' activations replicated
    assert sp2 == full // 2
    recompute = memory_cap.activation_bytes_per_token(QWEN_1_5B, ParallelDims(world_size=1), True)
    assert recompute == 28 * 2 * 1536 + full // 28  # every layer's input, one layer's full set
    experts = MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=512, shared_expert_ffn_hidden_size=1024)
    moe = _qwen(1024, 0, 4, 8, 2, 128, experts)
    per_layer = 4 * 1024 + 20 * 128 + 3 * (2 * 512 + 1024) + 2 * 2 * 1024
    assert memory_cap.activation_bytes_per_token(moe, ParallelDims(world_size=1), False) == 4 * 2 * per_layer


def test_cap_arithmetic_and_adam_reserve():
    assert memory_cap.memory_token_cap(100_000, 0, 7) == int(100_000 * memory_cap.MEMORY_FRACTION // 7)
    assert memory_cap.memory_token_cap(100_000, 40_000, 7) == int(60_000 * memory_cap.MEMORY_FRACTION // 7)
    assert memory_cap.memory_token_cap(10, 40, 7) == 1  # never zero: a row goes alone
    trained = types.SimpleNamespace(optimizer=object(), models=[torch.nn.Linear(10, 10)])  # 110 parameters
    frozen = types.SimpleNamespace(optimizer=None, models=[torch.nn.Linear(10, 10)])
    assert memory_cap.adam_state_reserve([trained, frozen, None], False, 4) == 8 * 110
    assert memory_cap.adam_state_reserve([trained], True, 2) == 8 * 110 // 2  # sharded over data parallelism


def _rows(mbs) -> list[int]:
    return sorted(r for mb in mbs for r in mb["rows"].tolist())


@pytest.mark.parametrize("cap", [40, 90, 10_000])
def test_packed_rows_are_grouped_within_the_cap(cap):
    exp = skewed_experience(1, 16, 12, vocab=50, pad_id=0)
    width = exp.tokens.shape[1]
    capped = MicroBatcher(4, 0, 1, torch.device("cpu"), pack=True, token_cap=cap)(exp, torch.arange(16))
    plain = MicroBatcher(4, 0, 1, torch.device("cpu"), pack=True)(exp, torch.arange(16))
    assert _rows(capped) == _rows(plain) == list(range(16))
    lengths = exp.prompt_lens + exp.response_mask.sum(-1).long()
    for mb in capped:
        assert mb["tokens"].shape[1] <= max(min(4 * width, cap), int(lengths[mb["rows"]].max()))
    if cap >= 4 * width:  # the cap does not bind: the same micro-batches
        assert [mb["rows"].tolist() for mb in capped] == [mb["rows"].tolist() for mb in plain]
    else:
        assert len(capped) > len(plain)


def test_padded_micro_batches_take_fewer_rows_under_the_cap_in_one_shape():
    exp = skewed_experience(2, 16, 12, vocab=50, pad_id=0)
    width = exp.tokens.shape[1]
    mbs = MicroBatcher(8, 0, 1, torch.device("cpu"), token_cap=3 * width + 1)(exp, torch.arange(16))
    assert [mb["tokens"].shape for mb in mbs] == [(2, width)] * 8  # 2 divides 8: one shape
    assert _rows(mbs) == list(range(16))
    one = MicroBatcher(8, 0, 1, torch.device("cpu"), token_cap=1)(exp, torch.arange(16))
    assert len(one) == 16  # a row alone when even one exceeds the cap


def test_a_budget_or_the_interleaved_schedule_ignores_the_cap():
    exp = skewed_experience(3, 16, 12, vocab=50, pad_id=0)
    budget = MicroBatcher(4, 64, 1, torch.device("cpu"), pack=True, token_cap=20)
    assert budget.token_cap == 0 and all(mb["tokens"].shape[1] <= 64 for mb in budget(exp, torch.arange(16)))
    one = MicroBatcher(4, 0, 1, torch.device("cpu"), pack=True, shapes="one", token_cap=20)
    assert one.token_cap == 0 and [len(mb["rows"]) for mb in one(exp, torch.arange(16))] == [4] * 4


def test_the_cpu_cap_comes_from_the_hosts_memory_and_a_budget_has_none(groups, monkeypatch, capsys):
    """On the CPU the cap is MEMORY_FRACTION of this rank's share of the host's memory at the actor's count per
    token, and the startup line says so; a user's budget has no cap."""
    from config_compose import composed

    monkeypatch.setattr(memory_cap, "host_free_bytes", lambda: 10 * 2**30)
    per_token = memory_cap.activation_bytes_per_token(QWEN_0_5B, groups.dims, False)
    want = memory_cap.memory_token_cap(10 * 2**30, 0, per_token)
    actor = types.SimpleNamespace(optimizer=None, models=[])  # no AdamW states to reserve
    assert memory_cap.trainer_token_cap(composed(), QWEN_0_5B, groups, [actor]) == want
    line = capsys.readouterr().out
    assert (
        f"at most {want:,} tokens" in line
        and "10.0 GiB free (this rank's share of the host's memory)" in line
    )
    budget = composed("trainer.max_tokens_per_micro_batch=4096")
    assert memory_cap.trainer_token_cap(budget, QWEN_0_5B, groups, [actor]) == 0


def test_host_memory_is_split_among_the_hosts_ranks_and_bounded_by_a_cgroup(monkeypatch):
    monkeypatch.setattr(memory_cap, "_available_host_bytes", lambda: 64 * 2**30)
    limits = {"/sys/fs/cgroup/memory.max": None, "/sys/fs/cgroup/memory.current": None}
    monkeypatch.setattr(memory_cap, "_read_int", limits.get)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert memory_cap.host_free_bytes() == 64 * 2**30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert memory_cap.host_free_bytes() == 16 * 2**30
    limits.update({"/sys/fs/cgroup/memory.max": 24 * 2**30, "/sys/fs/cgroup/memory.current": 4 * 2**30})
    assert memory_cap.host_free_bytes() == 5 * 2**30  # the cgroup's 20 GiB left, over 4 ranks


def test_this_hosts_memory_and_cgroup_files_are_read(tmp_path):
    """The real reading: positive and no more than the physical memory; a cgroup file's number, none for
    cgroup v2's "max" or a missing file."""
    import os

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < memory_cap._available_host_bytes() <= physical
    (tmp_path / "limit").write_text("1073741824\n")
    (tmp_path / "unlimited").write_text("max\n")
    assert memory_cap._read_int(str(tmp_path / "limit")) == 2**30
    assert memory_cap._read_int(str(tmp_path / "unlimited")) is None
    assert memory_cap._read_int(str(tmp_path / "missing")) is None


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(10, 10)  # 110 parameters
        self.layer = torch.nn.Module()  # layer.mlp.experts.local_experts.0.*: 24, an expert's
        self.layer.mlp = torch.nn.Module()
        self.layer.mlp.experts = torch.nn.Module()
        self.layer.mlp.experts.local_experts = torch.nn.ModuleList([torch.nn.Linear(5, 4)])


@pytest.mark.parametrize(
    "overrides,world,layout,want",
    [
        ((), 2, {"tp": 2}, 0),  # dropped after each rollout
        (("rollout.keep_rollout_weights=true",), 2, {"tp": 2}, 2 * 110),  # merged: a copy (experts: no TP)
        (("rollout.keep_rollout_weights=true", "rollout.tp=2"), 2, {"tp": 2}, 0),  # views of the shard
        (
            ("rollout.keep_rollout_weights=true", "rollout.tp=2"),
            4,
            {"tp": 2, "pp": 2},
            110 + 24,
        ),  # other stage
        (("rollout.keep_rollout_weights=true",), 2, {"ep": 2}, 24),  # the other rank's expert
        (("rollout.keep_rollout_weights=true", "rollout.weight_sync=naive"), 2, {"tp": 2}, 0),
    ],
)
def test_kept_rollout_weights_are_reserved(overrides, world, layout, want):
    from config_compose import composed

    actor = types.SimpleNamespace(models=[_Layer()])
    dims = ParallelDims(world_size=world, **layout)
    cfg = composed(*overrides)
    assert memory_cap.kept_rollout_weights_reserve(cfg, actor, dims) == 4 * want  # float32 bytes
    assert memory_cap.kept_rollout_weights_reserve(cfg, None, dims) == 0


def test_a_larger_trained_critic_sets_the_count():
    one = ParallelDims(world_size=1)
    critic = types.SimpleNamespace(optimizer=object(), shape=QWEN_1_5B)
    frozen = types.SimpleNamespace(optimizer=None, shape=QWEN_1_5B)  # a reference or reward model
    small = memory_cap.activation_bytes_per_token(QWEN_0_5B, one, False)
    large = memory_cap.activation_bytes_per_token(QWEN_1_5B, one, False)
    assert memory_cap.trained_activation_bytes(QWEN_0_5B, [None, frozen], one, False) == small
    assert memory_cap.trained_activation_bytes(QWEN_0_5B, [None, frozen, critic], one, False) == large
