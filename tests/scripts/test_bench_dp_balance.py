"""scripts/bench/dp_balance.py: both layouts' `slowest_over_mean` against hand-computed values, and its JSON
over a few seeds (one row per DP size and mini-batch count that divides the prompts)."""

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench")
sys.path.insert(0, BENCH)

from dp_balance import layouts  # noqa: E402


def test_layouts_hand_computed():
    # rolled out: replica 0 holds groups 0, 1 (20 tokens), replica 1 groups 2, 3 (2): 20 / 11; re-dealt: 11 each
    assert layouts([10, 10, 1, 1], 2, 1) == (pytest.approx(20 / 11), 1.0)
    # two mini-batches of 2 groups over 2 replicas: one group each, nothing to re-deal
    assert layouts([10, 1, 7, 5], 2, 2) == (pytest.approx(17 / 11.5), pytest.approx(17 / 11.5))


def test_json_rows():
    cmd = [sys.executable, os.path.join(BENCH, "dp_balance.py"), "--lengths", "long_tail", "--prompts", "12"]
    out = subprocess.run(
        [*cmd, "--dp", "2", "3", "5", "--mini-batches", "1", "2", "--seeds", "4"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rows = json.loads(out)["rows"]
    assert [(r["dp"], r["mini_batches"]) for r in rows] == [(2, 1), (2, 2), (3, 1), (3, 2)]
    for r in rows:
        assert 1.0 <= r["balanced_median"] <= r["rolled_out_median"] <= r["rolled_out_worst"], r
