"""trainer.profile_steps (engine/step_profiler.py): the GPU's busy share per phase against hand-computed
intervals; a profiled CPU job's trace holds the step's phases (no busy metrics without a GPU); on CUDA
(marked `gpu`) every phase's busy share lies in [0, 1], those that compute on the GPU above 0, and the
unprofiled steps report none."""

from __future__ import annotations

import json
import os

import pytest
from trainer_jobs import read_metrics, run_job

from engine.step_profiler import busy_fractions, rollout_side_busy, trace_path


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_share_is_the_union_of_device_work_inside_each_phase():
    events = [
        _event("kernel", "gemm", 0, 10),
        _event("kernel", "attention", 5, 10),  # overlaps the gemm (another stream): [0, 15) counts once
        _event("gpu_memcpy", "Memcpy HtoD", 20, 5),
        _event("gpu_memset", "Memset", 30, 1),
        _event("kernel", "late", 45, 10),  # half inside phase/adv
        _event("gpu_user_annotation", "phase/gen", 0, 100),  # the annotation's GPU-side copy: not work
        _event("cpu_op", "aten::mm", 0, 100),
        _event("user_annotation", "phase/gen", 0, 20),
        _event("user_annotation", "phase/gen", 24, 10),  # a second occurrence: both count
        _event("user_annotation", "phase/adv", 40, 10),
        _event("user_annotation", "phase/empty", 60, 0),
        _event("user_annotation", "phase/idle", 70, 10),
        _event("user_annotation", "phase/step", 0, 80),
        _event("user_annotation", "Optimizer.step", 0, 80),  # not a phase
        {"ph": "M", "name": "process_name"},
    ]
    got = busy_fractions(events)
    want = {"gen": (15 + 1 + 1) / 30, "adv": 5 / 10, "idle": 0.0, "step": (15 + 5 + 1 + 10) / 80}
    assert got.keys() == want.keys(), got
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=1e-12), (name, got)
    window_inside_one_interval = [_event("kernel", "k", 0, 100), _event("user_annotation", "phase/x", 10, 5)]
    assert busy_fractions(window_inside_one_interval) == {"x": 1.0}
    assert busy_fractions([_event("user_annotation", "phase/x", 0, 5)]) == {"x": 0.0}
    # a split placement rollout rank sends its phases, not its window as the step's (the training rank's)
    sent = rollout_side_busy({f"perf/gpu_busy/{k}": v for k, v in got.items()})
    assert sent == {"perf/gpu_busy/gen": got["gen"], "perf/gpu_busy/adv": 0.5, "perf/gpu_busy/idle": 0.0}


def test_profiled_cpu_step_writes_a_trace_of_its_phases(tmp_path):
    out = str(tmp_path / "run")
    run_job(["algorithm=grpo", "trainer.profile_steps=[2]"], out)
    assert not os.path.exists(trace_path(out, 1, 0))
    with open(trace_path(out, 2, 0)) as f:
        events = json.load(f)["traceEvents"]
    phases = {
        e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("phase/")
    }
    assert {"phase/step", "phase/gen", "phase/reward", "phase/adv", "phase/update_actor"} <= phases, phases
    assert any(e.get("cat") == "cpu_op" for e in events)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert not any(k.startswith("perf/gpu_busy/") for r in rows for k in r), rows


@pytest.mark.gpu
def test_profiled_cuda_step_reports_how_busy_the_gpu_was_per_phase(tmp_path):
    out = str(tmp_path / "run")
    run_job(
        ["algorithm=grpo", "cluster=single_gpu", "trainer.total_steps=3", "trainer.profile_steps=[2]"], out
    )
    rows = read_metrics(out)
    busy = {k.removeprefix("perf/gpu_busy/"): v for k, v in rows[1].items() if k.startswith("perf/gpu_busy/")}
    assert all(0.0 <= v <= 1.0 for v in busy.values()), busy
    assert all(busy[phase] > 0.0 for phase in ("step", "gen", "update_actor")), busy  # reward: the host's
    assert not any(k.startswith("perf/gpu_busy/") for r in (rows[0], rows[2]) for k in r)
    with open(trace_path(out, 2, 0)) as f:
        assert any(e.get("cat") == "kernel" for e in json.load(f)["traceEvents"])
