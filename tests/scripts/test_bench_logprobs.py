"""scripts/bench/logprobs.py on CPU with tiny sizes: the three heads run and agree (float32)."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_logprobs_bench_runs_and_heads_agree():
    cmd = [
        sys.executable,
        "scripts/bench/logprobs.py",
        "--rows",
        "3",
        "--prompt-len",
        "5",
        "--response-len",
        "7",
    ]
    cmd += ["--hidden", "16", "--vocab", "300", "--iters", "1"]
    env = {**os.environ, "MASTER_PORT": "29571", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tokens"] == 21 and out["unfused"]["seconds"] > 0 and out["fused"]["seconds"] > 0
    assert max(out["max_diff"].values()) < 1e-5, out["max_diff"]
    assert out["one_pass"]["seconds"] > 0 and max(out["one_pass_max_diff"].values()) < 1e-5, out[
        "one_pass_max_diff"
    ]
