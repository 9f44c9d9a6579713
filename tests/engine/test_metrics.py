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


def test_resume_drops_lines_logged_after_the_checkpoint(tmp_path):
    import json

    from engine.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path), ["jsonl"], enabled=True, total_steps=6, progress_bar=False)
    for step in range(1, 6):
        logger.log(step, {"reward/mean": float(step)})
    logger.resume_at(3)  # the crashed run had logged steps 4-5 past its step-3 checkpoint
    logger.log(4, {"reward/mean": 40.0})
    logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["reward/mean"] == 40.0


def test_resume_drops_a_line_cut_by_a_kill(tmp_path, capsys):
    """A kill (or a full disk) mid-write leaves a cut last line: resuming drops it and says so, instead of
    failing to parse it; the bar of a resumed run starts at its step."""
    import json

    from engine.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in (1, 2, 3)))
    with open(path, "a") as f:
        f.write('{"step": 4, "reward/me')
    logger = MetricsLogger(str(tmp_path), ["jsonl"], enabled=True, total_steps=6, progress_bar=True)
    logger.resume_at(2)
    assert logger._bar.n == 2
    logger.log(3, {"reward/mean": 3.0})
    logger.close()
    assert [json.loads(line)["step"] for line in open(path)] == [1, 2, 3]
    assert "dropped 1 unreadable line" in capsys.readouterr().out
