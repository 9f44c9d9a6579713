"""scripts/bench/workload.py: the long-tailed response lengths every engine is given, and the rollout bench
enforcing them on CPU (native engine, tiny model); the rollout bench's MoE preset on CPU (tiny_moe)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))

from workload import describe, response_lengths  # noqa: E402


def test_long_tail_lengths_are_seeded_and_long_tailed():
    a = response_lengths("long_tail", 4096, 4096, seed=3)
    assert a == response_lengths("long_tail", 4096, 4096, seed=3)  # every engine gets the same lengths
    assert a != response_lengths("long_tail", 4096, 4096, seed=4)
    stats = describe(a, 4096)
    assert min(a) >= 1 and max(a) == 4096
    assert 0.9 * 1024 <= stats["median"] <= 1.1 * 1024, stats  # median 0.25 x max
    assert 0.04 <= stats["frac_at_max"] <= 0.06, stats  # ~5% at the limit
    assert response_lengths("fixed", 3, 512) == [512, 512, 512]
    with pytest.raises(ValueError, match="workload kind 'lognormal'"):
        response_lengths("lognormal", 3, 512)


def test_rollout_bench_enforces_the_lengths_on_cpu():
    cmd = [
        sys.executable,
        "scripts/bench/rollout.py",
        "--preset",
        "tiny",
        "--prompts",
        "12",
        "--prompt-len",
        "8",
    ]
    cmd += [
        "--new-tokens",
        "24",
        "--lengths",
        "long_tail",
        "--backends",
        "native,native_contiguous,transformers",
        "--seed",
        "5",
        "--repeats",
        "3",
    ]
    env = {**os.environ, "MASTER_PORT": "29573", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    lengths = response_lengths("long_tail", 12, 24, seed=5)
    assert report["lengths"]["total"] == sum(lengths) and report["lengths"]["kind"] == "long_tail"
    assert report["results"]["native"]["tokens"] == sum(lengths)
    assert "skipped" in report["results"]["transformers"]
    for name in ("native", "native_contiguous"):  # three timed calls each, their median reported
        r = report["results"][name]
        assert len(r["seconds_each"]) == 3 and r["seconds"] == sorted(r["seconds_each"])[1]
        assert r["tokens"] == sum(lengths)
    assert report["results"]["native_contiguous"]["greedy_agree_first_token"] == 1.0


def test_rollout_bench_runs_the_tiny_moe_preset_on_cpu():
    import torch
    from rollout_models import model_shape, random_rollout_weights

    from engine.models.moe import stack_experts

    shape = model_shape("tiny_moe")
    params = random_rollout_weights(shape, torch.device("cpu"), seed=0).params
    pre = "decoder.layers.1.mlp."
    fc1 = [params[f"{pre}experts.local_experts.{e}.linear_fc1.weight"] for e in range(shape.moe.num_experts)]
    assert stack_experts(fc1).data_ptr() == fc1[0].data_ptr()  # the grouped experts read them in place
    assert params[pre + "router.weight"].shape == (shape.moe.num_experts, shape.hidden_size)
    cmd = [sys.executable, "scripts/bench/rollout.py", "--preset", "tiny_moe", "--backends", "native"]
    cmd += ["--prompts", "6", "--prompt-len", "8", "--new-tokens", "12"]
    env = {**os.environ, "MASTER_PORT": "29574", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["preset"] == "tiny_moe" and report["results"]["native"]["tokens"] == 6 * 12


def test_rollout_bench_warm_up_has_the_timed_calls_cache():
    """With per-prompt limits the warm-up decodes at most 512 tokens a row yet keeps the timed call's cache
    length (the engine sizes it from `max_new_tokens`), so the decode attention's key splits, which follow
    the cache's capacity, are those of the timed call at every width."""
    import torch
    from rollout import warm_up
    from rollout_models import model_shape, random_rollout_weights

    from engine.rollout.base import SamplingParams
    from engine.rollout.native import NativeRollout

    shape, cpu = model_shape("tiny"), torch.device("cpu")
    shape = dataclasses.replace(shape, max_position_embeddings=1024)  # room for limits past 512
    engine = NativeRollout(shape, cpu, 8)
    engine.set_weights(random_rollout_weights(shape, cpu, seed=0))
    prompts = [[1, 2, 3]] * 4
    sampling = SamplingParams(max_new_tokens=600, max_new_tokens_per_prompt=(600, 40, 9, 1), ignore_eos=True)
    warm_up(engine, prompts, sampling)
    warmed = engine.last_stats["seq_len"]
    assert engine.last_stats["decode_steps"] < 512  # the spread's limits, not the timed call's
    engine.generate(prompts, sampling)
    assert warmed == engine.last_stats["seq_len"] >= 600


def test_e2e_bench_trains_the_long_tailed_workload_on_cpu():
    """scripts/bench/e2e.py --lengths long_tail (world size 1, tiny preset): the dataset's per-row caps reach
    the rollout, so the trainer counts exactly the workload's real tokens (prompts + drawn lengths x n)."""
    prompts, n, prompt_len, max_len = 8, 2, 16, 24
    cmd = [sys.executable, "scripts/bench/e2e.py", "--preset", "tiny", "--cluster", "cpu", "--prompts", "8"]
    cmd += ["--n", "2", "--prompt-len", "16", "--response-len", "24", "--lengths", "long_tail", "--seed", "5"]
    cmd += ["--steps", "2", "--micro-batch", "4", "--max-tokens", "0", "--max-num-seqs", "16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    lengths = response_lengths("long_tail", prompts, max_len, seed=5)
    assert report["lengths"]["kind"] == "long_tail" and report["lengths"]["total"] == sum(lengths)
    ours = report["ours"]
    assert "error" not in ours, ours.get("error")
    real = prompts * n * prompt_len + n * sum(lengths)
    assert ours["tokens"] == real and ours["tokens_trained"] == real, ours
    assert abs(ours["response_length_mean"] - sum(lengths) / prompts) < 1e-6
    assert ours["bound_s"] == ours["bound_generation_s"] + ours["bound_update_s"] > 0  # roofline.step_bound
    assert ours["step_over_bound"] == ours["step_s"] / ours["bound_s"]
    assert ours["generation_roofline_fraction"] == ours["bound_generation_s"] / ours["timing"]["gen"]


def test_rollout_bench_default_backends_leave_native_tiles_to_attention_tiles():
    """The default backends are all of them but `native_tiles`, which runs only with the tiles it times (the
    README's CPU smoke test, `rollout.py --preset tiny`, gives no flags)."""
    import rollout

    default = rollout.parse_args([]).backends.split(",")
    assert "native_tiles" not in default and {"native", "native_uncapped", "vllm"} <= set(default)
    tiles = rollout.parse_args(["--attention-tiles", "64,4,2,64"])
    assert "native_tiles" in tiles.backends.split(",")
    assert tiles.attention_tiles.attention_knobs()["max_registers"] == 64
    with pytest.raises(SystemExit):
        rollout.parse_args(["--backends", "native,native_tiles"])
