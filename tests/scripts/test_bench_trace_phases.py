"""scripts/bench/trace_phases.py on a hand-made trace: per phase the busy share (the trainer's perf/gpu_busy),
idle time by gap length, device time by kernel kind and the top kernels, all against hand-computed values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

from trace_phases import summarise  # noqa: E402

from engine.step_profiler import busy_fractions  # noqa: E402


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_phase_summary_by_hand():
    events = [
        _event("user_annotation", "phase/gen", 1000, 1000),
        _event("user_annotation", "phase/update_actor", 3000, 500),
        _event("user_annotation", "phase/step", 1000, 2500),
        # gen: [1000, 1200) idle 0; two overlapping kernels to 1300; a 5 us gap; a 50 us gap; then idle to 2000
        _event("kernel", "ampere_bf16_gemm_128x64", 1000, 200),
        _event("kernel", "flash_fwd_kernel", 1100, 200),  # overlaps the gemm: busy to 1300 once
        _event("kernel", "ampere_bf16_gemm_128x64", 1305, 95),  # 5 us after: under 10 us
        _event("gpu_memcpy", "Memcpy DtoD", 1450, 50),  # 50 us after: 10 to 100 us
        # 500 us idle to the phase's end: 100 us and over
        _event("kernel", "triton_poi_fused_add_0", 3100, 300),  # update: 100 us idle before, 100 after
        _event("gpu_user_annotation", "phase/gen", 1000, 1000),  # not work
    ]
    got = summarise(events, top=2)
    gen = got["gen"]
    assert gen["wall_ms"] == 1.0 and gen["busy_ms"] == pytest.approx(0.445)  # 300 + 95 + 50 us
    assert gen["busy_fraction"] == pytest.approx(0.445)
    assert gen["idle_ms"] == {"under_10us": 0.005, "10_to_100us": 0.05, "100us_and_over": 0.5}
    assert gen["gaps_100us_and_over"] == 1
    assert gen["kernel_ms_by_kind"] == {"gemm": 0.295, "attention": 0.2, "memcpy/memset": 0.05}
    assert [k["name"] for k in gen["top_kernels"]] == ["ampere_bf16_gemm_128x64", "flash_fwd_kernel"]
    assert gen["top_kernels"][0] == {"name": "ampere_bf16_gemm_128x64", "ms": 0.295, "calls": 2}
    update = got["update_actor"]
    assert update["busy_fraction"] == pytest.approx(0.6) and update["gaps_100us_and_over"] == 2
    assert update["kernel_ms_by_kind"] == {"triton (torch.compile)": 0.3}
    step = got["step"]  # both phases and the 1,600 us of idle from gen's last work to the update's kernel
    assert step["busy_ms"] == pytest.approx(0.745)
    assert step["idle_ms"] == {"under_10us": 0.005, "10_to_100us": 0.05, "100us_and_over": 1.7}
    for phase, share in busy_fractions(events).items():  # the trainer's metric, the same union
        assert got[phase]["busy_fraction"] == pytest.approx(share, abs=1e-4), phase
