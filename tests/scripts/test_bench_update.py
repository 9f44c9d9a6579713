"""scripts/bench/update.py on CPU: the tiny preset through three variants, the profile and the fusion check.

World size 1 (the script is its own gloo process); ~15 s. Checks the JSON contract the GPU runs rely on,
not speed: every variant reports the keys below, and the same weights give the same first-update loss and
grad norm whatever the fusions (bit-equal on CPU, where the fused and reference paths run the same math).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "update.py"
VARIANT_KEYS = {
    "fusions",
    "adam",
    "params",
    "update_s",
    "update_s_all",
    "tokens_all",
    "first_update_s",
    "warmup_s_all",
    "tokens_per_s",
    "mfu",
    "fwd_bwd_s",
    "fwd_bwd_tokens_per_s",
    "fwd_bwd_mfu",
    "optimizer_s",
    "mfu_palm",
    "peak_memory_gb",
    "grad_norm",
    "loss",
    "skipped_steps",
    "profile",
    "kernel_ms",
    "gpu_busy_fraction",
    "kernel_categories",
    "cuda_graphs",
    "layer_calls_captured",
    "layer_calls_replayed",
}


def test_update_bench_tiny_cpu(tmp_path):
    args = ["--preset", "tiny", "--rows", "6", "--seq", "24", "--prompt-len", "8", "--max-tokens", "80"]
    args += [
        "--variants",
        "none,all+fused_adam,all+foreach_adam",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--profile",
        "--log-ops",
        "1024",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this checkout's engine
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(
            key, None
        )  # left by in-process world-1 tests (parallel/launch.py); the bench is its own world
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "update.json").read_text())
    assert result["tokens"] == 6 * 24 and result["device"] == "cpu"
    assert result["packed"] and len(result["micro_batches"]) > 1  # the trainer's layout: rows back to back
    assert all(b == 1 and s <= 80 for b, s in result["micro_batches"])
    assert sum(s for _, s in result["micro_batches"]) == 6 * 24
    variants = result["variants"]
    none, fused, foreach = variants["none"], variants["all+fused_adam"], variants["all+foreach_adam"]
    for v in (none, fused, foreach):
        assert set(v) == VARIANT_KEYS | {"ops"}, set(v) ^ VARIANT_KEYS
        assert v["update_s"] >= v["fwd_bwd_s"] > 0 and len(v["update_s_all"]) == 2
        assert v["tokens_all"] == [6 * 24] * 2 and v["first_update_s"] > 0
        assert v["warmup_s_all"][0] == round(v["first_update_s"], 4) and len(v["warmup_s_all"]) >= 1
        assert v["mfu"] is None and v["skipped_steps"] == 0  # no MFU on CPU
        assert Path(v["profile"]).read_text().startswith("top 30 CPU ops")
        ops = Path(v["ops"]).read_text()  # the residual adds (forward) and their gradients' (backward)
        assert ops.startswith("ops of one update") and "bias_dropout_add" in ops and "Backward" in ops
    assert none["fusions"] == {"rms_norm": False, "rope": False, "wgrad": False, "qkv_bias": False}
    assert fused["fusions"] == {"rms_norm": True, "rope": True, "wgrad": True, "qkv_bias": True}
    assert (fused["adam"], foreach["adam"]) == ("fused", "foreach")
    for v in (fused, foreach):  # same weights and batch: the first update's figures match bit for bit
        assert (v["loss"], v["grad_norm"]) == (none["loss"], none["grad_norm"])
    check = result["fusion_check"]
    for kernel in ("rms_norm", "rope"):
        for part in ("output", "grad"):
            assert check[kernel][part]["max_abs_diff"] == 0.0  # CPU: same math, same order


def test_update_bench_long_tail_draws_new_lengths_per_update(tmp_path):
    """--lengths long_tail --fresh-lengths: each update has its own response lengths (the first batch's are the
    draw of seed 0, the timed ones of seeds 1 and 2), packed by the budget; the figures count real tokens."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from workload import response_lengths

    args = ["--preset", "tiny", "--rows", "6", "--seq", "40", "--prompt-len", "8", "--max-tokens", "80"]
    args += ["--lengths", "long_tail", "--fresh-lengths", "--warmup", "1", "--iters", "2", "--no-check"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    want = [6 * 8 + sum(response_lengths("long_tail", 6, 32, seed)) for seed in (0, 1, 2)]
    assert len(set(want)) == 3  # the three draws differ, so the check below can fail
    assert result["tokens"] == want[0] == sum(s for _, s in result["micro_batches"])
    assert result["lengths"] == "long_tail" and result["fresh_lengths"] and result["packed"]
    (variant,) = result["variants"].values()
    assert variant["tokens_all"] == want[1:]
    assert variant["update_s"] > 0 and variant["skipped_steps"] == 0


def test_update_bench_shared_prompts_compute_each_prompt_once(tmp_path):
    """--n 3 --share-prompts: 6 rows of 24 tokens as 2 prompts of 8 with 3 responses of 16 each: 2 x (8 + 48)
    tokens computed, the first update's loss and gradient norm those of the same rows packed whole (float32
    summation order)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    args = ["--preset", "tiny", "--rows", "6", "--seq", "24", "--prompt-len", "8", "--max-tokens", "80"]
    args += ["--n", "3", "--dtype", "float32", "--warmup", "1", "--iters", "1", "--no-check"]
    results = []
    for extra in ([], ["--share-prompts"]):
        out = tmp_path / ("shared" if extra else "whole")
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *args, *extra, "--out", str(out)],
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    whole, shared = results
    assert sum(s for _, s in whole["micro_batches"]) == 6 * 24
    assert sum(s for _, s in shared["micro_batches"]) == 2 * (8 + 3 * 16)
    (a,), (b,) = whole["variants"].values(), shared["variants"].values()
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]) and a["grad_norm"] > 0
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]


def test_default_warmup_covers_the_cudnn_switch():
    """Without --warmup the bench warms up through the update that holds a shape's CUDNN_FROM_CALL-th layer
    call on CUDA (cuDNN's first plans: seconds on a fresh machine), 2 updates at least, 10 at most; 2 on CPU
    and where every update draws new lengths; --warmup as given."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from update import MAX_AUTO_WARMUP, warmup_updates

    from engine.models.packed_attention import CUDNN_FROM_CALL

    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def warmup(layers, micro_batches, device=cuda, warmup=None, fresh=False):
        args = SimpleNamespace(warmup=warmup, fresh_lengths=fresh)
        return warmup_updates(
            args, SimpleNamespace(num_layers=layers), SimpleNamespace(mbs=[0] * micro_batches), device
        )

    for layers, mbs, want in ((24, 8, 3), (28, 16, 2), (24, 1, MAX_AUTO_WARMUP), (2, 300, 2)):
        got = warmup(layers, mbs)
        assert got == want, (layers, mbs, got)
        calls = layers * mbs
        assert got == MAX_AUTO_WARMUP or got * calls >= CUDNN_FROM_CALL  # the switch lies in the warm-ups
        assert got == 2 or (got - 1) * calls < CUDNN_FROM_CALL  # and not one update more than it takes
    assert warmup(24, 8, device=cpu) == 2 and warmup(24, 8, fresh=True) == 2
    assert warmup(24, 8, warmup=1) == 1 and warmup(24, 8, device=cpu, warmup=0) == 0
