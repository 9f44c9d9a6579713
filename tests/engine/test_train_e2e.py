"""`python -m engine.train` end to end on CPU: one process, and a 4-rank torchrun launch with TP=2, PP=2.

Asserts metrics.jsonl has one line per step with every documented key, all finite.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from distributed import run_torchrun, subprocess_env

DOCUMENTED_KEYS = {
    "step",
    "reward/mean",
    "reward/std",
    "reward/min",
    "reward/max",
    "response_length/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/lr",
    "timing/reshard",
    "timing/gen",
    "timing/reward",
    "timing/ref",
    "timing/adv",
    "timing/update_actor",
    "timing/step",
    "perf/tokens_per_s_per_gpu",
    "perf/total_tokens",
    "perf/tokens_per_micro_batch",
    "rollout_engine/chunks",
    "rollout_engine/decode_steps",
}
SHORT_RUN = [
    "trainer.total_steps=3",
    "trainer.test_freq=3",
    "trainer.progress_bar=false",
    "data.batch_size=8",
    "rollout.n=4",
    "trainer.micro_batch_size=4",
]


def read_metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_metrics(rows: list[dict], steps: int) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        missing = DOCUMENTED_KEYS - set(row)
        assert not missing, f"missing metric keys {sorted(missing)}"
        for key, value in row.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), f"{key}={value!r}"
        # the native engine's own counts: per chunk of rows, one decode step per new token after the first
        chunks, steps = row["rollout_engine/chunks"], row["rollout_engine/decode_steps"]
        assert chunks >= 1 and 1 <= steps <= 4 * chunks, (chunks, steps)
    assert "val/reward_mean" in rows[-1]
    assert 0.0 <= rows[-1]["reward/mean"] <= 1.0


def test_single_process_run(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.train", f"trainer.output_dir={out}", *SHORT_RUN, "critic.lr=1e-4"],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_metrics(read_metrics(str(out)), 3)
    # the run header: the presets' names, then one line per key this combination ignores
    header = [line for line in proc.stdout.splitlines() if line.startswith(("run: ", "warning: "))]
    assert (
        header[0].startswith("run: model=tiny (random init) algorithm=grpo")
        and "cluster=cpu (cpu)" in header[0]
    )
    assert header[1].startswith("run: world 1 = tp 1 x pp 1 x dp 1") and str(out) in header[1]
    assert header[2:] == [
        "warning: critic.lr=0.0001 is ignored: only algorithm.adv_estimator=gae (PPO) has a critic"
    ]
    # a quiet start: one line names the kernels instead of megatron-core's fallback warnings
    assert [line for line in proc.stdout.splitlines() if line.startswith("kernels: ")] == [
        "kernels: attention torch SDPA, RMSNorm torch, RoPE eager, output head chunked, Adam torch "
        "(no Transformer Engine, no Apex: megatron-core's local fallbacks); each group's prompt once per "
        "micro-batch (trainer.share_prompts)"
    ]
    assert "Apex" not in proc.stderr and "UserWarning" not in proc.stderr, proc.stderr[-2000:]
    # the picture of the run, written at the end
    assert f"plot: {out}/metrics.png" in proc.stdout
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_four_rank_tp2_pp2_rollout_tp2_run(tmp_path):
    out = tmp_path / "run4"
    output = run_torchrun(
        "-m",
        4,
        [
            "engine.train",
            f"trainer.output_dir={out}",
            "parallel.tp=2",
            "parallel.pp=2",
            "rollout.tp=2",
            *SHORT_RUN,
        ],
    )
    check_metrics(read_metrics(str(out)), 3)
    # ranks other than 0 print nothing but errors (torchrun's --tee prefixes each line with its rank)
    others = [
        line for line in output.splitlines() if line.startswith(("[default1]", "[default2]", "[default3]"))
    ]
    assert not [line for line in others if line.split(":", 1)[-1].strip()], others[:10]
    assert sum(line.startswith("[default0]:run: model=") for line in output.splitlines()) == 1
