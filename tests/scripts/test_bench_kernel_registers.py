"""scripts/bench/kernel_registers.py: the decode attention compiled ahead of time for sm90 on this CPU machine
(Triton's ptxas and cuobjdump), as the engine launches it, with the ladder of register caps `occupancy_ladder` builds (its
arithmetic by hand: tests/engine/test_occupancy.py)."""

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)

from kernel_registers import launch_ints  # noqa: E402

triton = pytest.importorskip("triton")


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
    args = ["--presets", "qwen2_5_1_5b", "--layouts", "paged", "--sourced", "sourced", "--splits", "1,4"]
    args += ["--rope", "inside", "--occupancy", "--plan-widths", "24,64,512", "--cache-len", "4352"]
    root = os.path.join(BENCH, "..", "..")
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, os.path.join(BENCH, "kernel_registers.py"), *args],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    import json

    report = json.loads(out.stdout.strip().splitlines()[-1])
    row, split_row = report["kernels"]
    assert row["splits"] == 1 and split_row["splits"] == 4
    assert report["arch"] == 90 and row["layout"] == "paged" and row["tiles"] == [64, 4, 2]
    assert 16 <= row["regs"] <= 255 and row["spill_bytes"] >= 0
    assert row["shared_bytes"] >= 2 * 64 * 128 * 2  # at least one key and one value tile of bf16
    assert row["programs_per_sm"] >= 1
    ladder = row[
        "occupancy_ladder"
    ]  # (Triton 3.6: 160 registers, 3 per SM uncapped; 120: 4, nothing spilled)
    assert ladder[0] == dict(
        cap=None, regs=row["regs"], spill_bytes=0, programs_per_sm=row["programs_per_sm"]
    )
    for lower, higher in zip(ladder, ladder[1:]):
        assert higher["programs_per_sm"] == lower["programs_per_sm"] + 1 and higher["regs"] <= higher["cap"]
        assert higher["spill_bytes"] <= 32
    # the plan: each width's splits as num_splits gives them on 132 SMs (24 rows x 2 groups: 11 splits, 64: 5,
    # 512: 1 by hand: 4 waves of 132 over 48 and 128 pairs, 1,024 pairs fill them), its cap from its ladder
    (plan,) = report["plans"]
    assert [(w, s) for w, s, _ in plan["widths"]] == [(24, 11), (64, 5), (512, 1)]
    for width, splits, cap in plan["widths"]:
        ladder = (row if splits == 1 else split_row)["occupancy_ladder"]
        assert cap in {r["cap"] for r in ladder}, (width, cap, ladder)
