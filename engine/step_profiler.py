"""trainer.profile_steps: chosen steps run under torch.profiler, each writing a Chrome trace per rank and, on
CUDA, how busy the GPU was in each phase of the step.

A profiled step N writes `output_dir/profile/step_{N}_rank{R}.json` on every rank, to open in
https://ui.perfetto.dev or chrome://tracing (a split placement rollout rank traces the step's first round and
the weights' arrival, and sends its phases' busy shares with the step's metrics: engine/split/worker.py): the
host's ops, the GPU's kernels, copies and memsets (those replayed from CUDA graphs too), and each phase of the
step as a `phase/<name>` annotation (engine/metrics.py `PhaseTimer`; `phase/step` spans the whole step). From
the same trace, on CUDA, the logging rank's `perf/gpu_busy/<phase>`: the share of the phase's wall time in
which at least one kernel, copy or memset ran on this process's GPU (the union of their intervals, so
overlapping streams count once; a phase that runs twice in a step, as `reshard` does, counts both).
`perf/gpu_busy/gen` is the rollout's: what the GPU does while the rollout waits on the host (launches,
sampling decisions, admitting rows) or on a few long rows is idle. The phases synchronise the device at their
ends, so a phase's window holds its own GPU work.

Profiling costs time (the host records every op; the trace is written after the step) and host memory (a
long-tailed rollout records a kernel per layer op per decode step: a 1.5B step to 4,096 tokens holds about a
million events): a profiled step's timings and throughput are not the run's. `scripts/bench/e2e.py
--gpu-busy` profiles one step more than it times.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
from collections.abc import Iterator

import torch

PHASE = "phase/"
"""Prefix of the step's phase annotations (`torch.profiler.record_function`, engine/metrics.py)."""
DEVICE_WORK = frozenset(("kernel", "gpu_memcpy", "gpu_memset"))
"""Chrome trace categories of work on the GPU (kineto's names)."""
PROFILE_DIR = "profile"
STEP = "step"
"""The annotation that spans a profiled step (on a split placement rollout rank, its profiled part)."""


def trace_path(output_dir: str, step: int, rank: int) -> str:
    return os.path.join(output_dir, PROFILE_DIR, f"step_{step}_rank{rank}.json")


def device_work(events: list[dict]) -> tuple[list[float], list[float]]:
    """The device's work in a Chrome trace's `traceEvents` (`DEVICE_WORK`) as disjoint intervals: (starts,
    ends), sorted, overlapping work (other streams) merged."""
    starts: list[float] = []
    ends: list[float] = []
    for a, b in sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_WORK and "dur" in e
    ):
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    return starts, ends


def work_inside(starts: list[float], ends: list[float], a: float, b: float) -> list[tuple[float, float]]:
    """The parts of the disjoint sorted intervals (`device_work`) inside [a, b)."""
    i, j = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)
    return [(max(s, a), min(e, b)) for s, e in zip(starts[i:j], ends[i:j])]


def phase_windows(events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Each phase's occurrences (`phase/<name>` annotations) as (start, end), by name without the prefix."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "user_annotation" and name.startswith(PHASE) and "dur" in e:
            spans.setdefault(name.removeprefix(PHASE), []).append((e["ts"], e["ts"] + e["dur"]))
    return spans


def busy_fractions(events: list[dict]) -> dict[str, float]:
    """Per phase annotated in a Chrome trace's `traceEvents`: the share of its wall time covered by the union
    of the device's work intervals (`DEVICE_WORK`), over all its occurrences. Phases of zero duration are
    left out; a trace without device work gives zeros."""
    starts, ends = device_work(events)
    out = {}
    for name, windows in phase_windows(events).items():
        wall = sum(b - a for a, b in windows)
        if wall > 0:
            busy = sum(e - s for a, b in windows for s, e in work_inside(starts, ends, a, b))
            out[name] = busy / wall
    return out


def rollout_side_busy(busy: dict[str, float]) -> dict[str, float]:
    """A split placement rollout rank's busy shares to send with its step's metrics: its phases (`gen`,
    `reward`), not its profiled window (`perf/gpu_busy/step`), which would stand for the training rank's."""
    return {k: v for k, v in busy.items() if k != f"perf/gpu_busy/{STEP}"}


class StepProfiler:
    """Runs the steps named in `steps` (1-based, as logged) under torch.profiler (module docstring)."""

    def __init__(self, steps: list[int], output_dir: str, rank: int, device: torch.device):
        self.steps = frozenset(steps)
        self.output_dir = output_dir
        self.rank = rank
        self.device = device

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[dict[str, float]]:
        """Profiles the block if `step` is chosen; the yielded dict holds `perf/gpu_busy/<phase>` once the block
        has run (on CUDA; empty otherwise)."""
        metrics: dict[str, float] = {}
        if step not in self.steps:
            yield metrics
            return
        cuda = self.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            with torch.profiler.record_function(f"{PHASE}{STEP}"):
                yield metrics
            if cuda:
                torch.cuda.synchronize(self.device)
        path = trace_path(self.output_dir, step, self.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)
        if cuda:
            with open(path) as f:
                events = json.load(f)["traceEvents"]
            metrics.update({f"perf/gpu_busy/{k}": v for k, v in busy_fractions(events).items()})
