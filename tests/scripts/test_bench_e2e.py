"""scripts/bench/e2e.py on CPU (one torchrun job of the tiny preset, ~15 s): `--fresh-lengths` gives every
step its own prompts and long-tailed length draw, and the trainer trains exactly those (its own token count
per timed step equals the one the bench computes from the draws: rows taken in order, per-prompt limits
honoured); `--gpu-busy` profiles one step more, outside those figures; on an H100 (an `nvidia-smi` on PATH
that names one) the tight limit is also held at that card's memory bandwidth. Speed is for the GPU; this
checks the plumbing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "e2e.py"


def test_fresh_lengths_train_each_steps_own_draw(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from workload import response_lengths

    args = ["--cluster", "cpu", "--preset", "tiny", "--prompts", "2", "--n", "2", "--prompt-len", "16"]
    args += ["--response-len", "12", "--lengths", "long_tail", "--fresh-lengths", "--steps", "3"]
    args += ["--max-tokens", "0", "--micro-batch", "2", "--gpu-busy", "trainer.share_prompts=true"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    smi = tmp_path / "nvidia-smi"  # what e2e.py asks of the card, answered as an H100 would
    smi.write_text('#!/bin/sh\necho "NVIDIA H100 80GB HBM3"\n')
    smi.chmod(0o755)
    env["PATH"] = os.pathsep.join([str(tmp_path), env.get("PATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the bench launches its own world
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = result["ours"]
    assert "error" not in ours, ours["error"]
    assert result["overrides"] == ["trainer.share_prompts=true"] and result["micro_batch"] == 2
    assert 0 < ours["shared_prompt_fraction"] < 1  # 2 responses per prompt: the prompts computed once
    want = [2 * 2 * 16 + 2 * sum(response_lengths("long_tail", 2, 12, seed)) for seed in range(3)]
    assert ours["fresh_lengths"] and ours["tokens_all"] == want
    assert want[1] != want[2]  # the timed steps differ, so the trainer's count below can disagree
    assert ours["tokens_trained"] == ours["tokens"] == (want[1] + want[2]) / 2  # median of the timed steps
    # --gpu-busy: a fourth step under the profiler, left out of the figures above; no GPU, no busy shares
    assert len(ours["step_s_all"]) == 3 and ours["gpu_busy"] == {}, ours
    assert os.listdir(ours["profile_dir"]) == ["step_4_rank0.json"]
    # the tiny model's decode steps read more bytes than they compute: slower memory, a longer limit
    assert ours["bound_this_gpu_s"] > ours["bound_s"] > 0
    assert ours["step_over_bound_this_gpu"] < ours["step_over_bound"]
