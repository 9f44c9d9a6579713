"""How large the trainer's micro-batches are, from the config alone: packed or padded, rows or tokens.

`trainer.max_tokens_per_micro_batch` > 0 is a token budget (engine/roles/dynamic_batch.py). Otherwise
micro-batches are cut by rows, `micro_batch_rows` of them (packed: as many tokens at the batch's width), at most
what the memory holds (engine/roles/memory_cap.py). Where `trainer.micro_batch_size` is left empty as well, and
the run is packed and in one pipeline stage (`sized_by_memory`), they grow to at least `MEMORY_SIZED_TOKENS`
tokens under that cap. On CUDA 8 rows of 512-token responses are ~6k tokens, which leave the GPU waiting on
the host's launches (one H200, commit 9faba0b: 0.5B 10.14 s per GRPO step eager, 5.10 s with the layers from
CUDA graphs; 1.5B 12.47 and 9.34 s), where 32,768-token micro-batches run the update GPU-bound (0.5B 3.82 s,
1.5B 8.66 s at 2.6x and 2.3x the peak memory; scripts/bench/README.md "Update"). On the CPU (its cap from the
host's available memory) the same holds for the per-micro-batch cost of megatron's layers: the default job
(`python -m engine.train`, 16 prompts x 8 rows of ~20 tokens) took 0.25 s per step in 8-row micro-batches and
0.07 s in one (2 cores). A number in `trainer.micro_batch_size` is the user's size and is kept; pipeline
stages keep rows (their schedule wants more micro-batches in flight, not larger ones).
"""

from __future__ import annotations

from engine.config import TrainerConfig

DEFAULT_MICRO_BATCH_ROWS = 8
"""Rows per micro-batch where trainer.micro_batch_size is empty and micro-batches are cut by rows."""

MEMORY_SIZED_TOKENS = 32768
"""The fewest tokens of a micro-batch sized by memory (module docstring): e2e.py's token budget, under which
its one-H200 GRPO figures of scripts/bench/README.md ran until it took the trainer's default."""


MEASURED_DEVICES = ("cuda", "cpu")
"""Devices whose free memory the cap measures (engine/roles/memory_cap.py `free_memory_bytes`)."""


def packs_sequences(t: TrainerConfig) -> bool:
    """Whether micro-batches are packed (trainer.pack_sequences, by default on)."""
    return t.pack_sequences is not False


def micro_batch_rows(t: TrainerConfig) -> int:
    """Rows per micro-batch where micro-batches are cut by rows: trainer.micro_batch_size, 8 where empty."""
    return DEFAULT_MICRO_BATCH_ROWS if t.micro_batch_size is None else t.micro_batch_size


def sized_by_memory(t: TrainerConfig, device: str, pp: int) -> bool:
    """Whether micro-batches grow past `micro_batch_rows` rows to `MEMORY_SIZED_TOKENS` tokens where the memory
    holds them (module docstring): trainer.micro_batch_size and max_tokens_per_micro_batch empty, packed, on
    a `device` whose memory the cap measures, with `pp` pipeline stages 1."""
    no_size = t.micro_batch_size is None and not t.max_tokens_per_micro_batch
    return no_size and packs_sequences(t) and device in MEASURED_DEVICES and pp == 1


def fill_tokens(t: TrainerConfig, device: str, pp: int) -> int:
    """The fewest tokens packed micro-batches grow to: `MEMORY_SIZED_TOKENS` where `sized_by_memory`, else 0."""
    return MEMORY_SIZED_TOKENS if sized_by_memory(t, device, pp) else 0
