"""scripts/bench/host_costs.py on CPU (in-process, ~1 s): every op of the table is timed on a tiny preset.
The figures are for the GPU's host; this checks the plumbing."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import host_costs  # noqa: E402


def test_every_op_is_timed(capsys):
    host_costs.main(["--preset", "tiny", "--tokens", "24", "--rows", "3", "--iters", "3"])
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["tokens"] == 24 and out["rows"] == 3
    costs = out["us_per_call"]
    assert len(costs) == 10 and all(us > 0 for us in costs.values())
    assert {
        "packed_positions",
        "fused_rope_thd (RoPE of packed q)",
        "engine rms_norm forward+backward",
    } <= set(costs)
