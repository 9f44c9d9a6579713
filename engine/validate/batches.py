"""Batch sizes across DP, mini-batches and micro-batches, megatron's interleaved schedule and the token budget."""

from __future__ import annotations

from engine.config import TrainConfig
from engine.micro_batch_sizing import micro_batch_rows, sized_by_memory
from engine.tasks.embedded import EMBEDDED_TASKS
from engine.validate.rules import fail, one_of, positive
from parallel.dims import ParallelDims


def validate_batches(cfg: TrainConfig, dims: ParallelDims) -> None:
    b, mbs = cfg.data.batch_size, micro_batch_rows(cfg.trainer)
    positive("data.batch_size", b)
    if cfg.trainer.micro_batch_size is not None:  # empty: engine/micro_batch_sizing.py
        positive("trainer.micro_batch_size", cfg.trainer.micro_batch_size)
    positive("data.max_prompt_len", cfg.data.max_prompt_len)
    one_of("data.bad_rows", cfg.data.bad_rows, ("error", "skip"))
    one_of("data.embedded_task", cfg.data.embedded_task, EMBEDDED_TASKS)
    positive("data.embedded_digits", cfg.data.embedded_digits)
    if b % dims.dp:
        fail(
            "data.batch_size",
            b,
            f"must be divisible by the data-parallel size {dims.dp} (= world / (tp*pp))",
            f"use a multiple of {dims.dp}",
        )
    prompts_per_rank = b // dims.dp
    mini = cfg.algorithm.num_mini_batches
    if prompts_per_rank % mini:
        fail(
            "algorithm.num_mini_batches",
            mini,
            f"must divide the prompts per DP rank (data.batch_size / dp = {prompts_per_rank})",
            "keep whole groups in each mini-batch: pick a divisor",
        )
    seqs_per_mini = prompts_per_rank // mini * cfg.rollout.n
    budget = cfg.trainer.max_tokens_per_micro_batch
    if budget:
        validate_token_budget(cfg, dims)
        return  # micro_batch_size is not used
    if sized_by_memory(cfg.trainer, cfg.cluster.device, dims.pp):
        return  # rows grouped under a token count (engine/micro_batch_sizing.py)
    if seqs_per_mini % mbs:
        fail(
            "trainer.micro_batch_size",
            mbs,
            f"must divide the sequences per mini-batch per DP rank (batch_size/dp/num_mini_batches*rollout.n = {seqs_per_mini})",
            f"use a divisor of {seqs_per_mini}",
        )
    validate_interleaved_schedule(cfg, dims, seqs_per_mini)


def validate_interleaved_schedule(cfg: TrainConfig, dims: ParallelDims, seqs_per_mini: int) -> None:
    """parallel.vpp > 1: megatron's interleaved schedule (in groups of pp micro-batches, its default) needs a
    count of micro-batches per call that is a positive multiple of parallel.pp. The update's count is fixed
    by the config; forward-only calls (old/ref log-probs, values, reward model, validation, ReMax greedy)
    take any row count: engine/step/update.py `forward_rows` pads their micro-batch count at run time."""
    if dims.vpp == 1:
        return
    mbs, pp = micro_batch_rows(cfg.trainer), dims.pp
    count = seqs_per_mini // mbs
    if count % pp == 0:
        return
    fits = [
        d for d in range(1, seqs_per_mini + 1) if seqs_per_mini % d == 0 and (seqs_per_mini // d) % pp == 0
    ]
    fix = (
        f"use trainer.micro_batch_size in {fits}"
        if fits
        else f"make the sequences per mini-batch a multiple of {pp} (raise data.batch_size or rollout.n, or "
        "lower algorithm.num_mini_batches)"
    )
    fail(
        "trainer.micro_batch_size",
        mbs,
        f"gives {count} micro-batches per update (sequences per mini-batch per DP rank: batch_size/dp/"
        f"num_mini_batches*rollout.n = {seqs_per_mini}), but the interleaved pipeline schedule "
        f"(parallel.vpp={dims.vpp}) needs a positive multiple of parallel.pp={pp}",
        f"{fix}, or set parallel.vpp=1",
    )


def validate_token_budget(cfg: TrainConfig, dims: ParallelDims) -> None:
    budget = cfg.trainer.max_tokens_per_micro_batch
    if budget < 0:
        fail("trainer.max_tokens_per_micro_batch", budget, "must be >= 0", "use 0 to turn it off")
    multiple = dims.seq_multiple
    # +1: the target slot of the last token (as engine/step/batch.py lays sequences out)
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens + 1
    longest = -(-longest // multiple) * multiple
    if budget < longest:
        fail(
            "trainer.max_tokens_per_micro_batch",
            budget,
            f"must fit the longest sequence, data.max_prompt_len + rollout.max_new_tokens + 1 = {longest} tokens",
            f"set it to at least {longest} (a few times more packs several rows per micro-batch)",
        )
    if dims.vpp > 1:
        fail(
            "trainer.max_tokens_per_micro_batch",
            budget,
            f"token-budget micro-batches vary in number and shape, which the interleaved pipeline schedule "
            f"(parallel.vpp={dims.vpp}) does not support",
            "set parallel.vpp=1, or trainer.max_tokens_per_micro_batch=0",
        )
