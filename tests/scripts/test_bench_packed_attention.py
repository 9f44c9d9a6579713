"""scripts/bench/packed_attention.py on CPU (in-process, ~2 s): the step's rows cut by the trainer's token
budget, and the engine's packed attention and the padded copy (SDPA on CPU) against float32 SDPA over the rows on the first
micro-batch, for a fixed and a long-tailed step. Speed is for the GPU; this checks the plumbing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import packed_attention as bench  # noqa: E402

ARGS = ["--preset", "tiny", "--prompts", "4", "--n", "3", "--prompt-len", "16", "--response-len", "40"]


@pytest.mark.parametrize("lengths", ["fixed", "long_tail"])
def test_the_step_is_packed_by_the_budget_and_the_engine_path_is_exact(lengths, capsys):
    threshold = bench.packed_module.CUDNN_FROM_CALL
    bench.main([*ARGS, "--lengths", lengths, "--max-tokens", "120"])
    assert bench.packed_module.CUDNN_FROM_CALL == threshold  # the bench's steady state left the process
    out = json.loads(capsys.readouterr().out)
    args = bench.parse_args([*ARGS, "--lengths", lengths, "--max-tokens", "120"])
    mbs = bench.micro_batch_lengths(args)
    assert out["rows"] == 12 and out["micro_batches"] == len(mbs)
    assert all(sum(mb) <= 120 or len(mb) == 1 for mb in mbs)
    if lengths == "fixed":
        assert mbs == [[56, 56]] * 6
    assert out["tokens"] == sum(map(sum, mbs))
    assert set(out["kernels"]) == {"engine", "padded_sdpa"}  # the CUDA-only kernels are skipped on CPU
    for kernel in out["kernels"].values():
        assert max(kernel["max_abs_error"].values()) < 1e-5


def test_the_padded_copy_is_exact_for_rows_of_different_lengths():
    import torch

    lengths = [5, 17, 1, 9]
    q, k, v, g = bench.inputs(lengths, 4, 2, 8, torch.device("cpu"), torch.float32, 0)
    batch = (q, k, v, g, bench.offsets(lengths, "cpu"), max(lengths))
    for fn in (bench.padded_sdpa, bench.engine):
        assert max(bench.parity(fn, batch, 0.3).values()) < 1e-5
