"""scripts/bench/roofline.py, the issue's tight limits of a step, against values computed by hand from
Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14 heads in 2 KV groups of dim 64, FFN 4,864, 151,936 tied
vocabulary, QKV bias)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench"))

from roofline import (  # noqa: E402
    GEMM_FLOPS,
    HBM_BYTES_PER_S,
    DecodeShapes,
    add_rooflines,
    decode_roofline_by_width,
    dense,
    generation_roofline,
    gpu_hbm_bytes_per_s,
    report_rates,
    step_bound,
    update_bound_s,
)

# per layer: QKV 896 x (896 + 2 x 128) + its bias, out-projection 896 x 896, SwiGLU MLP 3 x 896 x 4,864; the
# tied embedding read once as the head
LAYER = 896 * 1152 + 1152 + 896 * 896 + 3 * 896 * 4864
MATMUL = 24 * LAYER + 151_936 * 896
KV_PER_POSITION = 24 * 2 * 2 * 64 * 2  # K and V, 2 groups of dim 64, bf16
ATTENTION_PER_KEY = 4 * 24 * 14 * 64


def test_decode_shapes_of_qwen2_5_0_5b():
    s = DecodeShapes.of("qwen2_5_0_5b")
    assert s.matmul_params == MATMUL == 493_988_864
    assert s.weight_bytes == 2 * MATMUL
    assert s.kv_bytes_per_position == KV_PER_POSITION and s.attention_flops_per_key == ATTENTION_PER_KEY


def _prefill(rows: int, prompt: int) -> float:
    flops = rows * (2 * MATMUL * prompt + ATTENTION_PER_KEY * prompt * (prompt + 1) / 2)
    return max(flops / GEMM_FLOPS, 2 * MATMUL / HBM_BYTES_PER_S)


def test_narrow_steps_are_bound_by_weights_and_kv_and_finished_rows_leave():
    """Rows of 1 and 3 tokens after 4-token prompts: the prefill makes both first tokens, then two steps of
    the longer row alone (at 5 and 6 keys), each reading every weight and its keys."""
    got = generation_roofline("qwen2_5_0_5b", 4, [1, 3])
    steps = [(2 * MATMUL + keys * KV_PER_POSITION) / HBM_BYTES_PER_S for keys in (5, 6)]
    assert got["decode_steps"] == 2 and got["tokens"] == 4
    assert got["prefill_s"] == pytest.approx(_prefill(2, 4), rel=1e-12)
    assert got["decode_s"] == pytest.approx(sum(steps), rel=1e-12)
    assert got["seconds"] == pytest.approx(_prefill(2, 4) + sum(steps), rel=1e-12)


def test_another_cards_bandwidth_moves_the_bytes_bound_steps_only():
    """The same narrow rows at an H100's 3.35 TB/s: the weight- and key-bound decode steps and the prompt-sized
    prefill (bound by its weights) take 4.8 / 3.35 as long; the FLOP-bound wide step keeps its time."""
    h100 = gpu_hbm_bytes_per_s("NVIDIA H100 80GB HBM3")
    assert h100 == 3.35e12 and gpu_hbm_bytes_per_s("NVIDIA H200") == HBM_BYTES_PER_S
    assert gpu_hbm_bytes_per_s("NVIDIA A10G") is None
    narrow = generation_roofline("qwen2_5_0_5b", 4, [1, 3], hbm_bytes_per_s=h100)
    steps = [(2 * MATMUL + keys * KV_PER_POSITION) / h100 for keys in (5, 6)]
    assert narrow["decode_s"] == pytest.approx(sum(steps), rel=1e-12)
    assert narrow["prefill_s"] == pytest.approx(2 * MATMUL / h100, rel=1e-12)
    wide = generation_roofline("qwen2_5_0_5b", 1, [2] * 4096, hbm_bytes_per_s=h100)
    assert wide["decode_s"] == pytest.approx(
        4096 * (2 * MATMUL + 2 * ATTENTION_PER_KEY) / GEMM_FLOPS, rel=1e-12
    )
    assert report_rates("NVIDIA H100 80GB HBM3") == {"": HBM_BYTES_PER_S, "_this_gpu": h100}
    assert report_rates("NVIDIA H200") == report_rates("") == {"": HBM_BYTES_PER_S}


def test_decode_steps_grouped_by_the_width_that_holds_their_live_rows():
    """Rows of 1, 3 and 5 tokens after 4-token prompts: steps 1-2 have two live rows (width 2 of 1, 2, 4),
    steps 3-4 one (width 1); nothing runs at width 4. The groups add up to the roofline's decode time."""
    got = decode_roofline_by_width("qwen2_5_0_5b", 4, [1, 3, 5], [4, 1, 2])
    step = [(2 * MATMUL + keys * KV_PER_POSITION) / HBM_BYTES_PER_S for keys in (2 * 5, 2 * 6, 7, 8)]
    assert set(got) == {1, 2}
    assert got[2][0] == 2 and got[2][1] == pytest.approx(step[0] + step[1], rel=1e-12)
    assert got[1][0] == 2 and got[1][1] == pytest.approx(step[2] + step[3], rel=1e-12)
    total = generation_roofline("qwen2_5_0_5b", 4, [1, 3, 5])["decode_s"]
    assert got[1][1] + got[2][1] == pytest.approx(total, rel=1e-12)
    assert decode_roofline_by_width("qwen2_5_0_5b", 4, [1, 3, 5], [1])[1][0] == 4  # the widest takes the rest


def test_rollout_reports_the_issues_roofline_and_the_cards_own():
    """rollout.py's keys on an H100: the H200's roofline and fraction as the issue states them, the same at
    3.35 TB/s as `_this_gpu`, and per-width step times where a backend reports its steps by width."""
    report, rows = {}, [1, 3, 5]
    results = {
        "native": {"seconds": 2.0, "engine_stats": {"decode_steps_by_width": {1: 2, 2: 2}}},
        "vllm": {},
    }
    add_rooflines(report, results, "qwen2_5_0_5b", 4, rows, "NVIDIA H100 80GB HBM3")
    for suffix, rate in (("", HBM_BYTES_PER_S), ("_this_gpu", 3.35e12)):
        roof = generation_roofline("qwen2_5_0_5b", 4, rows, hbm_bytes_per_s=rate)
        assert report["roofline" + suffix]["seconds"] == round(roof["seconds"], 3)
        assert report["roofline" + suffix]["hbm_tb_per_s"] == rate / 1e12
        assert results["native"]["roofline_fraction" + suffix] == round(roof["seconds"] / 2.0, 3)
        by_width = results["native"]["engine_stats"]["roofline_ms_per_step_by_width" + suffix]
        step = (2 * MATMUL + 7 * KV_PER_POSITION) / rate, (2 * MATMUL + 8 * KV_PER_POSITION) / rate
        assert by_width[1] == round(1e3 * sum(step) / 2, 3) and set(by_width) == {1, 2}
    assert "roofline_fraction" not in results["vllm"]
    report = {}
    add_rooflines(report, {}, "qwen2_5_0_5b", 4, rows, "NVIDIA H200")
    assert set(report) == {"roofline"}


def test_wide_steps_are_bound_by_flops():
    """4,096 rows of 2 tokens after 1-token prompts: the one decode step computes 2 x matmul parameters per row
    plus two keys' attention, more than its bytes take."""
    got = generation_roofline("qwen2_5_0_5b", 1, [2] * 4096)
    flops = 4096 * (2 * MATMUL + 2 * ATTENTION_PER_KEY)
    assert flops / GEMM_FLOPS > (2 * MATMUL + 4096 * 2 * KV_PER_POSITION) / HBM_BYTES_PER_S
    assert got["decode_s"] == pytest.approx(flops / GEMM_FLOPS, rel=1e-12)


def test_replicas_share_the_rows_and_the_slowest_bounds_the_phase():
    """Two GPUs, one replica each: rows 8, 5, 3, 1 dealt by length (8 and 3 to one, 5 and 1 to the other), so
    the bound is the first replica's; at rollout_tp=2 one replica reads half its weights per GPU."""
    lengths = [3, 8, 1, 5]
    two = generation_roofline("qwen2_5_0_5b", 16, lengths, gpus=2)
    assert two["seconds"] == pytest.approx(
        generation_roofline("qwen2_5_0_5b", 16, [8, 3])["seconds"], rel=1e-12
    )
    tp2 = generation_roofline("qwen2_5_0_5b", 16, lengths, gpus=2, rollout_tp=2)
    assert tp2["seconds"] == pytest.approx(generation_roofline("qwen2_5_0_5b", 16, lengths)["seconds"] / 2)
    with pytest.raises(ValueError, match="gpus=3 is not a multiple of rollout_tp=2"):
        generation_roofline("qwen2_5_0_5b", 16, lengths, gpus=3, rollout_tp=2)


def test_step_bound_is_generation_plus_the_update_at_70_percent():
    """2 prompts x 3 samples: the rows repeat each prompt's length; the update trains every real token at 70%
    of 989 TFLOP/s over 6 x all parameters (norms and both uses of the tied embedding counted once)."""
    params = MATMUL + 896 * 49
    tokens = 6 * 10 + 3 * (4 + 7)
    assert update_bound_s("qwen2_5_0_5b", tokens) == pytest.approx(6 * params * tokens / (0.7 * 989e12))
    got = step_bound("qwen2_5_0_5b", 2, 3, 10, [4, 7])
    gen = generation_roofline("qwen2_5_0_5b", 10, [4, 4, 4, 7, 7, 7])["seconds"]
    assert got["generation_s"] == gen and got["update_s"] == update_bound_s("qwen2_5_0_5b", tokens)
    assert got["seconds"] == gen + got["update_s"]


def test_mixture_of_experts_presets_have_no_roofline():
    assert dense("qwen2_5_7b") and not dense("tiny_moe")
    with pytest.raises(ValueError, match="preset 'tiny_moe': the roofline counts dense models only"):
        DecodeShapes.of("tiny_moe")
