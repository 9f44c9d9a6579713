"""GRPO and PPO learn (issue 7's must-show): on the embedded `target` task from random init, the mean training
reward of the last 10 of 40 steps beats the first 10 by a clear margin, at TP=2 x PP=2 (world size 4, padded
micro-batches) and TP=1 x DP=2 (world size 2, packed token-budget micro-batches); one torchrun launch per
layout (tests/engine/learning_script.py).

Margin: a run that does not learn stays at the first-10 mean (~0.03) within ~0.005 (the 10-step mean of a
per-step reward with std ~0.015). Measured last-10 minus first-10 at 40 steps: DP=2 seeds 1/2/3: GRPO +0.025,
+0.064, +0.041; PPO +0.19, +0.17, +0.028; TP=2 x PP=2 seed 1: GRPO +0.127, PPO +0.103. CPU runs with one
thread per rank are deterministic (a second launch repeated these numbers), so the seeds below (2 at DP=2,
1 at TP=2 x PP=2) pass by 3x the margin or more; 0.02 holds on every seed tried.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import run_torchrun

SCRIPT = str(Path(__file__).with_name("learning_script.py"))
MARGIN = 0.02


def _learned(out: str) -> dict[str, dict]:
    rows = [
        json.loads(line.split("learn ", 1)[1].split(" in ")[0])
        for line in out.splitlines()
        if "learn {" in line
    ]
    return {row["job"]: row for row in rows}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "nproc", "seed"), [("tp2_pp2", 4, 1), ("dp2", 2, 2)])
def test_grpo_and_ppo_mean_reward_rises(tmp_path, layout, nproc, seed):
    jobs = _learned(run_torchrun(SCRIPT, nproc, [str(tmp_path), layout, str(seed)]))
    for alg in ("grpo", "ppo"):
        row = jobs[f"{alg}_{layout}"]
        assert row["steps"] == 40, row
        assert row["last"] > row["first"] + MARGIN, row


@pytest.mark.slow
def test_default_job_with_tiny_moe_learns(tmp_path):
    """World size 1, in this process: the default job (embedded copy task, GRPO, native rollout) with
    model=tiny_moe for 60 steps; the mean reward of the last 10 steps beats the first 10 by MARGIN
    (measured, seed 1: 0.023 -> 0.064)."""
    from trainer_jobs import read_metrics, run_job

    default_sizes = ["data.batch_size=16", "rollout.n=8", "trainer.micro_batch_size=8"]
    run_job(["model=tiny_moe", "trainer.total_steps=60", *default_sizes], str(tmp_path))
    rewards = [row["reward/mean"] for row in read_metrics(str(tmp_path))]
    assert len(rewards) == 60
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + MARGIN, (first, last)
