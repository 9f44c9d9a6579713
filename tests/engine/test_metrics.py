"""PhaseTimer (no processes): per-phase seconds everywhere, per-phase peak memory on CUDA only."""

from __future__ import annotations

import pytest
import torch

from engine.metrics import PhaseTimer


def test_cpu_timer_has_seconds_and_no_memory_keys():
    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("gen"):
        torch.zeros(1000)
    with timer.phase("gen"):
        pass
    metrics = timer.as_metrics()
    assert set(metrics) == {"timing/gen"} and metrics["timing/gen"] >= 0


@pytest.mark.gpu
def test_cuda_timer_reports_each_phase_own_peak():
    device = torch.device("cuda")
    timer = PhaseTimer(device)
    with timer.phase("big"):
        x = torch.empty(2**28, dtype=torch.uint8, device=device)  # 0.25 GiB, freed below
        del x
    with timer.phase("small"):
        y = torch.empty(2**20, dtype=torch.uint8, device=device)
        del y
    m = timer.as_metrics()
    assert m["perf/max_memory_allocated_gb/big"] >= 0.25
    assert m["perf/max_memory_allocated_gb/small"] < m["perf/max_memory_allocated_gb/big"] - 0.2
