"""scripts/bench/multi_turn.py on CPU with the tiny model: every episode has --turns assistant turns, the
generated tokens are turns x turn tokens per episode, and vLLM is reported as skipped."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_multi_turn_bench_runs_on_cpu():
    cmd = [
        sys.executable,
        "scripts/bench/multi_turn.py",
        "--preset",
        "tiny",
        "--prompts",
        "4",
        "--turns",
        "3",
    ]
    cmd += ["--turn-tokens", "5", "--tool-latency-ms", "1"]
    env = {**os.environ, "MASTER_PORT": "29573", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    native = out["results"]["native"]
    assert native["episodes"] == 4 and native["generated_tokens"] == 4 * 3 * 5
    assert native["tool_tokens"] == 4 * 2 * out["tool_turn_tokens"]
    assert native["episode_stats"]["tool_calls"] == 4 * 2  # totals over the call's episodes
    assert "skipped" in out["results"]["vllm"]
