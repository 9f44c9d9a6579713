"""One run per output directory (engine/checkpoint/run_dir.py): the lock, and whether a run may start there.

The lock is tested with two real processes: a holder process (a small Python child) and this test process
or a `python -m engine.train` run (world size 1). The fresh-vs-resume rules are tested without processes
on real files.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.checkpoint.run_dir import LOCK_FILE, OutputDirError, RunLock, prepare_output_dir
from engine.config import TrainerConfig

HOLD = "import sys; from engine.checkpoint.run_dir import RunLock; RunLock.acquire(sys.argv[1]); print('held', flush=True); sys.stdin.read()"


def _holder(output_dir: Path) -> subprocess.Popen:
    """A process that holds the lock on `output_dir` until killed or its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(output_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_is_refused_while_the_first_holds_the_directory(tmp_path):
    """Two processes: while a live process holds the lock, a start there is refused naming its pid and host;
    once it is killed (its lock left behind), a start takes the stale lock over with a message, and a run
    refused for another reason (item 2) still releases the lock at exit (`python -m engine.train`)."""
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        with pytest.raises(OutputDirError) as err:
            RunLock.acquire(str(out))
        text = str(err.value)
        for needle in (f"pid {holder.pid} on host {socket.gethostname()}", str(out / LOCK_FILE), "another"):
            assert needle in text, (needle, text)
    finally:
        holder.kill()
        holder.wait()
    assert (out / LOCK_FILE).exists()  # SIGKILL: nothing released it
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # an earlier run's history
    proc = subprocess.run(
        [sys.executable, "-m", "engine.train", f"trainer.output_dir={out}", "trainer.total_steps=1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert f"taking over the stale lock {out / LOCK_FILE} of pid {holder.pid}" in text, text[-3000:]
    for needle in ("holds an earlier run's outputs", "trainer.resume=auto", "trainer.overwrite=true"):
        assert needle in text, (needle, text[-3000:])
    assert not (out / LOCK_FILE).exists() and (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_release_removes_only_its_own_lock(tmp_path):
    lock = RunLock.acquire(str(tmp_path))
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    other = RunLock.acquire(str(tmp_path))
    lock.release()  # an old handle: not its lock any more
    assert (tmp_path / LOCK_FILE).exists()
    other.release()


def _checkpoint(root: Path, step: int, usable: bool = True) -> None:
    path = root / "checkpoints" / f"global_step_{step}"
    path.mkdir(parents=True)
    torch.save({"step": step}, path / "rank_0.pt")
    if usable:
        (path / "meta.json").write_text(json.dumps({"format": 1, "step": step, "layout": {"world_size": 1}}))


def test_a_fresh_run_in_an_old_runs_directory_is_refused_unless_overwrite(tmp_path):
    said: list[str] = []
    for name, make in (
        ("metrics", lambda d: (d / "metrics.jsonl").write_text('{"step": 1}\n')),
        ("ckpt", lambda d: _checkpoint(d, 2)),
    ):
        out = tmp_path / name
        out.mkdir()
        make(out)
        with pytest.raises(OutputDirError) as err:
            prepare_output_dir(str(out), TrainerConfig(resume="off"), said.append)
        text = str(err.value)
        for needle in (str(out), "trainer.resume=auto", "new trainer.output_dir", "trainer.overwrite=true"):
            assert needle in text, (needle, text)
        if name == "ckpt":
            prepare_output_dir(str(out), TrainerConfig(resume="auto"), said.append)  # continuing is fine
        else:  # no checkpoint: resume=auto would start fresh over the earlier run's metrics
            with pytest.raises(OutputDirError) as err:
                prepare_output_dir(str(out), TrainerConfig(resume="auto"), said.append)
            for needle in ("no checkpoint", "new trainer.output_dir", "trainer.overwrite=true"):
                assert needle in str(err.value), (needle, str(err.value))
        assert os.listdir(out)
        prepare_output_dir(str(out), TrainerConfig(resume="off", overwrite=True), said.append)
        assert os.listdir(out) == [], os.listdir(out)
        assert said[-1].startswith("run dir: trainer.overwrite=true") and str(out) in said[-1], said
    prepare_output_dir(str(tmp_path / "empty"), TrainerConfig(resume="off"), said.append)  # a new directory


def test_overwrite_starts_fresh_when_no_checkpoint_is_usable(tmp_path):
    """resume=auto: unusable checkpoints stop the run (engine/checkpoint/checkpoint.py) unless trainer.overwrite=true,
    which removes them; a usable one is resumed, overwrite or not."""
    said: list[str] = []
    good, bad = tmp_path / "good", tmp_path / "bad"
    _checkpoint(good, 1)
    _checkpoint(good, 2, usable=False)
    prepare_output_dir(str(good), TrainerConfig(resume="auto", overwrite=True), said.append)
    assert sorted(os.listdir(good / "checkpoints")) == ["global_step_1", "global_step_2"] and not said
    _checkpoint(bad, 1, usable=False)
    (bad / "metrics.jsonl").write_text('{"step": 1}\n')
    prepare_output_dir(str(bad), TrainerConfig(resume="auto", overwrite=True), said.append)
    assert os.listdir(bad) == [] and "meta.json is missing" in said[0], said
    fresh = tmp_path / "fresh"  # metrics of a run that saved no checkpoint
    fresh.mkdir()
    (fresh / "metrics.jsonl").write_text('{"step": 3}\n')
    prepare_output_dir(str(fresh), TrainerConfig(resume="auto", overwrite=True), said.append)
    assert os.listdir(fresh) == [] and "found no checkpoint" in said[-1], said
