"""trainer.profile_steps: chosen steps run under torch.profiler, each writing a Chrome trace per rank and, on
CUDA, how busy the GPU was in each phase of the step.

A profiled step N writes `output_dir/profile/step_{N}_rank{R}.json` on every rank (open it in
https://ui.perfetto.dev or chrome://tracing): the host's ops, the GPU's kernels, copies and memsets (those
replayed from CUDA graphs too), and each phase of the step as a `phase/<name>` annotation (engine/metrics.py
`PhaseTimer`; `phase/step` spans the whole step). From the same trace, on CUDA, the logging rank's
`perf/gpu_busy/<phase>`: the share of the phase's wall time in which at least one kernel, copy or memset ran on
this process's GPU (the union of their intervals, so overlapping streams count once; a phase that runs twice
in a step, as `reshard` does, counts both). `perf/gpu_busy/gen` is the rollout's: what the GPU does while
the rollout waits on the host (launches, sampling decisions, admitting rows) or on a few long rows is idle.
The phases synchronise the device at their ends, so a phase's window holds its own GPU work.

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


def trace_path(output_dir: str, step: int, rank: int) -> str:
    return os.path.join(output_dir, PROFILE_DIR, f"step_{step}_rank{rank}.json")


def busy_fractions(events: list[dict]) -> dict[str, float]:
    """Per phase annotated in a Chrome trace's `traceEvents`: the share of its wall time covered by the union
    of the device's work intervals (`DEVICE_WORK`), over all its occurrences. Phases of zero duration are
    left out; a trace without device work gives zeros."""
    work = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_WORK and "dur" in e)
    starts: list[float] = []
    ends: list[float] = []
    for a, b in work:  # merged: disjoint, sorted
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    covered = [0.0]
    for a, b in zip(starts, ends):
        covered.append(covered[-1] + b - a)

    def busy(a: float, b: float) -> float:
        """Device time inside [a, b): the whole intervals between, less the parts of the two at its edges."""
        i, j = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)
        if i >= j:
            return 0.0
        return covered[j] - covered[i] - max(0.0, a - starts[i]) - max(0.0, ends[j - 1] - b)

    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "user_annotation" and name.startswith(PHASE) and "dur" in e:
            spans.setdefault(name.removeprefix(PHASE), []).append((e["ts"], e["ts"] + e["dur"]))
    out = {}
    for name, windows in spans.items():
        wall = sum(b - a for a, b in windows)
        if wall > 0:
            out[name] = sum(busy(a, b) for a, b in windows) / wall
    return out


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
            with torch.profiler.record_function(f"{PHASE}step"):
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
