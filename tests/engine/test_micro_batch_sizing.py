"""Micro-batches sized by memory (engine/micro_batch_sizing.py, engine/roles/dynamic_batch.py).

Where trainer.micro_batch_size is left empty (packed, one pipeline stage, no budget; CUDA or the CPU) packed
rows are grouped under max(8 rows x the batch's width, MEMORY_SIZED_TOKENS), at most the memory cap: the same
micro-batches as an explicit token budget of that size (what scripts/bench/e2e.py measured); everywhere else
what the config says (a number of rows, a budget, pipeline stages, padded rows) is kept as before.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from config_compose import composed
from trainer_parity import skewed_experience

from engine.config import ConfigError, TrainerConfig
from engine.micro_batch_sizing import MEMORY_SIZED_TOKENS, micro_batch_rows, sized_by_memory
from engine.roles.dynamic_batch import MicroBatcher, trainer_batcher
from engine.roles.memory_cap import cap_line
from engine.validate.batches import validate_batches
from parallel.dims import ParallelDims

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "settings,device,pp,sized",
    [
        ({}, "cuda", 1, True),  # the default on one GPU stage
        ({}, "cpu", 1, True),  # the host's memory measured
        ({}, "cuda", 2, False),  # pipeline stages keep rows: more micro-batches in flight
        ({"micro_batch_size": 8}, "cuda", 1, False),  # the user's rows, even at the default's value
        ({"max_tokens_per_micro_batch": 4096}, "cuda", 1, False),  # the user's budget
        ({"pack_sequences": False}, "cuda", 1, False),  # padded rows keep one shape per call
        ({"pack_sequences": True}, "cuda", 1, True),
    ],
)
def test_sized_by_memory_only_where_nothing_sets_the_size(settings, device, pp, sized):
    t = TrainerConfig(**settings)
    assert sized_by_memory(t, device, pp) is sized
    assert micro_batch_rows(t) == settings.get("micro_batch_size", 8)


def _groups(mbs) -> list[list[int]]:
    return [mb["rows"].tolist() for mb in mbs]


def test_filled_micro_batches_are_an_explicit_budgets():
    """Packed, 2 rows at the batch's width are fewer tokens than the fill: the rows are grouped exactly as
    under a token budget of the fill (below the cap) or of the cap (where it binds); where rows x width is
    more, as without the fill."""
    exp = skewed_experience(4, 32, 16, vocab=50, pad_id=0)
    rows, width = torch.arange(32), exp.tokens.shape[1]
    fill = 5 * width
    filled = MicroBatcher(2, 0, 1, CPU, pack=True, token_cap=10_000, fill_tokens=fill)(exp, rows)
    budget = MicroBatcher(2, fill, 1, CPU, pack=True)(exp, rows)
    assert _groups(filled) == _groups(budget) and len(filled) < 16
    for a, b in zip(filled, budget):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["row_lengths"], b["row_lengths"])
    cap = 3 * width
    capped = MicroBatcher(2, 0, 1, CPU, pack=True, token_cap=cap, fill_tokens=fill)(exp, rows)
    assert _groups(capped) == _groups(MicroBatcher(2, cap, 1, CPU, pack=True)(exp, rows))
    wide = MicroBatcher(8, 0, 1, CPU, pack=True, token_cap=10_000, fill_tokens=fill)(exp, rows)
    assert _groups(wide) == _groups(MicroBatcher(8, 0, 1, CPU, pack=True)(exp, rows))


def test_the_fill_leaves_budgets_padded_rows_and_the_interleaved_schedule_alone():
    assert MicroBatcher(4, 64, 1, CPU, pack=True, fill_tokens=4096).fill_tokens == 0
    assert MicroBatcher(4, 0, 1, CPU, pack=False, token_cap=9, fill_tokens=4096).fill_tokens == 0
    assert MicroBatcher(4, 0, 1, CPU, pack=True, shapes="one", fill_tokens=4096).fill_tokens == 0


@pytest.mark.parametrize(
    "overrides,cap,fill",
    [
        ((), 50_000, MEMORY_SIZED_TOKENS),
        ((), 0, 0),  # no cap (a budget, the interleaved schedule): no fill
        (("trainer.micro_batch_size=8",), 50_000, 0),
        (("trainer.pack_sequences=false",), 50_000, 0),
    ],
)
def test_trainer_batcher_fills_where_the_config_leaves_the_size_to_memory(overrides, cap, fill):
    """`torch.device("cuda")` is only named here (nothing is cut), so this runs on CPU."""
    cfg = composed(*overrides)
    batcher = trainer_batcher(cfg.trainer, ParallelDims(world_size=1), torch.device("cuda"), token_cap=cap)
    assert (batcher.fill_tokens, batcher.micro_batch_size, batcher.token_cap) == (fill, 8, cap)
    two_stages = trainer_batcher(
        cfg.trainer, ParallelDims(world_size=2, pp=2), torch.device("cuda"), token_cap=cap
    )
    assert two_stages.fill_tokens == 0


def test_validation_needs_rows_to_divide_only_where_micro_batches_are_cut_by_rows():
    """6 sequences per mini-batch: 8 rows do not divide them. Sized by memory (packed, on CUDA or the CPU)
    nothing is cut by rows; rows the user set, or the default's 8 under pipeline stages, are named with the
    fix; 0 rows are refused."""
    cfg = composed("data.batch_size=2", "rollout.n=3")
    on_cuda = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, device="cuda"))
    one = ParallelDims(world_size=1)
    validate_batches(on_cuda, one)
    validate_batches(cfg, one)
    with pytest.raises(
        ConfigError, match=r"trainer.micro_batch_size=4: must divide.*Fix: use a divisor of 6"
    ):
        validate_batches(composed("data.batch_size=2", "rollout.n=3", "trainer.micro_batch_size=4"), one)
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_size=8: must divide"):
        validate_batches(cfg, ParallelDims(world_size=2, pp=2))
    with pytest.raises(ConfigError, match="trainer.micro_batch_size=0"):
        validate_batches(composed("trainer.micro_batch_size=0"), one)


def test_the_startup_line_says_how_micro_batches_are_sized():
    line = cap_line(41_000, 2**21, 120 * 2**30, 12 * 2**30, 8, MEMORY_SIZED_TOKENS)
    assert line.startswith("micro-batches: the larger of 32,768 tokens and 8 rows at the batch's width")
    assert "at most 41,000 tokens" in line
    assert cap_line(41_000, 2**21, 120 * 2**30, 0, 4, 0).startswith(
        "micro-batches: 4 rows at the batch's width"
    )
