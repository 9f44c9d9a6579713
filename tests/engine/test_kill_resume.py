"""SIGKILL mid-run, then trainer.resume=auto (world size 1): a `python -m engine.train` run saving every 2
steps is killed (its whole process group, SIGKILL) inside step 5, after step 4's checkpoint is complete;
the resumed run's steps 5-6 equal an uninterrupted run's.

Bit-exact (compared with ==): reward/mean, actor/grad_norm, actor/pg_loss and every other non-timing metric
of steps 5-6 (PPO: actor, critic, KL controller); the checkpoint holds parameters, optimizer and scheduler
state, the data position and the RNG states, and a one-thread CPU run is deterministic. Excluded: timing/*
and perf/* (wall clock). The stall is a user reward equal to the built-in rule (tests/engine/stall_reward.py), so the
kill lands at a known point instead of racing a 0.1 s step.

Also: a step's metrics line is written before that step's checkpoint (a save that fails keeps the line), and
the save's seconds are logged on the next step's line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from trainer_jobs import SHORT, read_metrics, run_job

from engine.errors import CheckpointError

REWARD = f"reward.fn={os.path.join(os.path.dirname(__file__), 'stall_reward.py')}:score"
RUN = [*SHORT, REWARD, "algorithm=ppo", "trainer.save_freq=2", "trainer.total_steps=6"]


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))}


def test_sigkill_after_step_4_checkpoint_then_resume_auto_matches_uninterrupted(tmp_path):
    ref = run_job(RUN, str(tmp_path / "ref"))
    assert ref.step == 6
    expected = {row["step"]: _comparable(row) for row in read_metrics(str(tmp_path / "ref"))}

    out = tmp_path / "killed"
    stall_at = out / "checkpoints" / "global_step_4"
    env = dict(os.environ, OMP_NUM_THREADS="1", STALL_AFTER_CHECKPOINT=str(stall_at))
    cmd = [sys.executable, "-m", "engine.train", *RUN, f"trainer.output_dir={out}"]
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(f"{stall_at}.stalled"):
            assert proc.poll() is None, f"the run ended before stalling:\n{proc.stdout.read()[-4000:]}"
            assert time.monotonic() < deadline, "no stall within 300 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert [row["step"] for row in read_metrics(str(out))] == [1, 2, 3, 4]  # killed inside step 5

    resumed = run_job([*RUN, "trainer.resume=auto"], str(out))
    assert resumed.step == 6
    rows = read_metrics(str(out))
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    for row in rows:
        assert _comparable(row) == expected[row["step"]], row["step"]
    for key in ("reward/mean", "actor/grad_norm", "actor/pg_loss"):
        assert key in rows[-1]


def test_step_line_is_written_before_its_checkpoint_and_the_save_time_on_the_next_line(tmp_path):
    failing = tmp_path / "failing"
    failing.mkdir()
    (failing / "checkpoints").write_text("a file where the checkpoint directory goes: every save fails\n")
    with pytest.raises(CheckpointError, match="global_step_1"):
        run_job([*SHORT, "trainer.save_freq=1", "trainer.resume=off"], str(failing))
    assert [row["step"] for row in read_metrics(str(failing))] == [1]

    saved = tmp_path / "saved"
    run_job([*SHORT, "trainer.save_freq=1", "trainer.total_steps=2"], str(saved))
    rows = read_metrics(str(saved))
    assert [row["step"] for row in rows] == [1, 2]
    assert "timing/save_checkpoint" not in rows[0]  # step 1's save ran after its line
    assert rows[1]["timing/save_checkpoint"] > 0
