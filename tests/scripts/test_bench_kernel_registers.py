"""scripts/bench/kernel_registers.py: the occupancy arithmetic by hand, and the decode attention compiled ahead
of time for sm90 on this CPU machine (Triton's ptxas and cuobjdump), as the engine launches it."""

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)

from kernel_registers import launch_ints, programs_per_sm  # noqa: E402

triton = pytest.importorskip("triton")


def test_programs_per_sm_by_hand():
    # 4 warps: 160 regs -> 160 x 32 x 4 = 20,480 of 65,536 -> 3; 120 -> 15,360 -> 4; 75 rounds up to 80 -> 6;
    # 170 rounds up to 176 -> 22,528 -> 2 (unrounded it would be 3)
    assert programs_per_sm(160, 4, 38912, 228) == 3
    assert programs_per_sm(120, 4, 38912, 228) == 4
    assert programs_per_sm(75, 4, 20480, 228) == 6
    assert programs_per_sm(170, 4, 20480, 228) == 2
    # shared memory binds: 71,680 + 1,024 per program in 228 KB -> 3 (registers would allow 6)
    assert programs_per_sm(80, 4, 71680, 228) == 3
    # warps bind: 64 per SM, 16 warps a program -> 4
    assert programs_per_sm(32, 16, 1024, 228) == 4


def test_launch_ints_follow_the_engine_layouts():
    contiguous = launch_ints(2, 6, 128, paged=False, splits=1, direct=True)
    assert contiguous["stride_kb"] == 4352 * 2 * 128 and contiguous["stride_tb"] == 0
    assert contiguous["stride_qh"] == 128 and contiguous["stride_qg"] == 8 * 128  # 6 query heads, key, value
    paged = launch_ints(2, 6, 128, paged=True, splits=4, direct=False)
    assert paged["stride_kb"] == 0 and paged["stride_ob"] == 0 and paged["splits"] == 4


def test_the_decode_attention_compiles_for_sm90_and_reports_its_resources():
    """One variant through the script (the 1.5B head shape, paged, sourced, RoPE inside): a register count a
    thread can have, the stack ptxas reports, shared memory for the pipelined key/value tiles, and at least one
    program per SM."""
    nvidia_bin = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(nvidia_bin, "cuobjdump")):
        pytest.skip("this Triton has no NVIDIA backend tools")
    args = ["--presets", "qwen2_5_1_5b", "--layouts", "paged", "--sourced", "sourced", "--splits", "1"]
    args += ["--rope", "inside"]
    root = os.path.join(BENCH, "..", "..")
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, os.path.join(BENCH, "kernel_registers.py"), *args],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    import json

    report = json.loads(out.stdout.strip().splitlines()[-1])
    (row,) = report["kernels"]
    assert report["arch"] == 90 and row["layout"] == "paged" and row["tiles"] == [64, 4, 2]
    assert 16 <= row["regs"] <= 255 and row["spill_bytes"] >= 0
    assert row["shared_bytes"] >= 2 * 64 * 128 * 2  # at least one key and one value tile of bf16
    assert row["programs_per_sm"] >= 1
