"""scripts/bench/verl_grpo.py without verl or a GPU: the files it prepares for verl's main_ppo (random-init
model directory, RLHF parquet with per-row caps, reward and agent-loop files), its hydra overrides, and the
parsing of verl's console-logger lines into the bench's JSON. World size: none."""

from __future__ import annotations

import os
import sys

import pyarrow.parquet as pq

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))

from verl_grpo import parse_args, parse_steps, prepare, summarize, verl_overrides  # noqa: E402
from workload import response_lengths  # noqa: E402

ARGS = ["--preset", "tiny", "--prompts", "6", "--n", "2", "--prompt-len", "16", "--response-len", "40"]


def test_prepare_writes_the_workload(tmp_path):
    args = parse_args([*ARGS, "--lengths", "long_tail", "--seed", "3"])
    files = prepare(args, str(tmp_path))
    caps = response_lengths("long_tail", 6, 40, 3)
    assert files["caps"] == caps
    table = pq.read_table(files["data"]).to_pylist()
    assert len(table) == 6
    assert [row["extra_info"]["max_tokens"] for row in table] == caps
    assert [row["extra_info"]["index"] for row in table] == list(range(6))
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(files["model"])
    for row in table:
        (message,) = row["prompt"]
        assert message["role"] == "user" and len(message["content"]) == 15
        ids = tok.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert len(ids) == 16 and ids[0] == tok.bos_token_id  # exactly --prompt-len tokens
    assert AutoConfig.from_pretrained(files["model"]).model_type == "qwen2"
    assert os.path.isfile(os.path.join(files["model"], "model.safetensors"))
    scope: dict = {}
    exec(open(files["reward"]).read(), scope)
    assert scope["compute_score"]("bench", "123", "", extra_info={}) == 0.0
    loops = open(files["agent_loops"]).read()
    assert "verl_capped_agent_loop.CappedSingleTurnAgentLoop" in loops
    assert os.path.isfile(os.path.join(ROOT, "scripts", "bench", "verl_capped_agent_loop.py"))

    overrides = dict(o.lstrip("+").split("=", 1) for o in verl_overrides(args, files, str(tmp_path)))
    assert overrides["data.train_batch_size"] == "6" and overrides["actor_rollout_ref.rollout.n"] == "2"
    assert overrides["data.max_response_length"] == "40" and overrides["data.max_prompt_length"] == "16"
    assert overrides["actor_rollout_ref.rollout.ignore_eos"] == "true"
    assert overrides["actor_rollout_ref.actor.use_kl_loss"] == "false"
    assert overrides["actor_rollout_ref.rollout.agent.agent_loop_config_path"] == files["agent_loops"]


def test_console_lines_to_json():
    lines = [
        "(TaskRunner pid=1) noise",
        "step:1 - timing_s/gen:np.float64(30.0) - timing_s/step:50.0 - perf/max_memory_allocated_gb:40.5\n",
        "step:2 - timing_s/gen:4.0 - timing_s/update_actor:3.5 - timing_s/step:np.float64(9.0)",
        "step:3 - timing_s/gen:4.5 - timing_s/step:11.0 - perf/max_memory_allocated_gb:41.0 - actor/lr:1e-06",
    ]
    steps = parse_steps(lines)
    assert sorted(steps) == [1, 2, 3] and steps[3]["actor/lr"] == 1e-6
    args = parse_args(ARGS)
    caps = [40] * 6
    out = summarize(args, caps, steps)
    assert out["step_s"] == 10.0 and out["step_s_all"] == [50.0, 9.0, 11.0]
    assert out["tokens_per_s_per_gpu"] == 2 * 6 * (16 + 40) / 10.0
    assert out["timing_s"][2] == {"timing_s/gen": 4.0, "timing_s/update_actor": 3.5, "timing_s/step": 9.0}
    assert out["peak_memory_gb"] == 41.0


def test_ray_prefixed_lines_and_one_step():
    """verl 0.9.1's lines as measured on the H200 (2026-12-02): Ray's colored actor prefix before `step:`,
    the actor's memory and MFU under `actor/perf/...` and `perf/mfu/actor`; one step gives no step_s."""
    line = (
        "\x1b[36m(TaskRunner pid=2851)\x1b[0m step:1 - actor/perf/max_memory_allocated_gb:np.float64(74.1) - "
        "perf/mfu/actor:np.float64(0.0163) - num_turns/min:np.int32(2) - timing_s/agent_loop/slowest/gen:3.0 - "
        "timing_s/gen:37.15 - timing_s/update_actor:75.7 - timing_s/step:138.36\n"
    )
    steps = parse_steps(["noise", line])
    assert sorted(steps) == [1] and steps[1]["timing_s/step"] == 138.36
    out = summarize(parse_args(ARGS), [40] * 6, steps)
    assert out["step_s"] is None and out["tokens_per_s_per_gpu"] is None
    assert out["first_step_s"] == 138.36 and out["steps_done"] == 1
    assert out["peak_memory_gb"] == 74.1 and out["mfu_update_actor"] == [0.0163]
    assert out["timing_s"][1] == {
        "timing_s/gen": 37.15,
        "timing_s/update_actor": 75.7,
        "timing_s/step": 138.36,
    }
