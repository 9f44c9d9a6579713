"""scripts/bench/shared_attention.py on CPU (in-process, ~2 s): the step cut into shared-prompt micro-batches
as the trainer cuts it, and both splits (their float reference kernels) against the gathered keys on the
first micro-batch, at fixed and long-tailed lengths. Speed is for the GPU; this checks the plumbing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import shared_attention as bench  # noqa: E402


def test_the_step_in_the_trainers_micro_batches_and_the_split_is_exact(capsys):
    args = ["--preset", "tiny", "--prompts", "5", "--n", "3", "--prompt-len", "8", "--response-len", "12"]
    bench.main([*args, "--max-tokens", "100"])  # 44-token units: two per micro-batch, the last one alone
    out = json.loads(capsys.readouterr().out)
    assert out["micro_batches"] == 3 and out["shapes"] == [[1, 3, 8, 12], [2, 3, 8, 12]]
    kernels = out["kernels"]
    shared = 5 * (8 + 3 * 12)
    assert (
        kernels["gathered"]["tokens"] == kernels["split_cudnn"]["tokens"] == kernels["split_flash"]["tokens"]
    )
    assert kernels["gathered"]["tokens"] == shared and kernels["whole_rows"]["tokens"] == 15 * 20
    for name in ("split_cudnn", "split_flash"):
        assert max(kernels[name]["max_abs_error"].values()) < 1e-5, name


def test_a_long_tailed_step_runs_the_varlen_split_only(capsys):
    args = ["--preset", "tiny", "--prompts", "6", "--n", "2", "--prompt-len", "8", "--response-len", "40"]
    bench.main([*args, "--lengths", "long_tail", "--max-tokens", "120"])
    kernels = json.loads(capsys.readouterr().out)["kernels"]
    assert "error" in kernels["split_cudnn"]  # no micro-batch of one shape
    assert max(kernels["split_flash"]["max_abs_error"].values()) < 1e-5
