"""Multi-turn rollouts with tool calls (issue 23), world size 1, all on CPU:
- an episode's token ids are exactly the generated ids and the rendered tool-turn ids, concatenated (each turn
  regenerated greedily from the episode's own prefix gives the same ids: nothing was re-tokenised); the mask
  is 1 on generated tokens and 0 on tool tokens, which stay in the training sequence as context;
- the native engine keeps each episode's KV cache across turns and gives the episodes of a full prefill;
- advantages with interior holes: tokens before a tool turn keep the outcome advantage (GRPO, GAE);
- tools: the calculator parses arithmetic without eval; a failing or slow user tool becomes an error message;
- the Python sandbox contains a fork bomb, an infinite loop, a write outside its directory and network use;
- the embedded calculator task learns (the model learns to call the tool and its reward rises);
- data rows carry `tools` and multi-message conversations; config errors name the key;
- long tool results keep their start and end around a marker;
- a short job logs `multi_turn/*` every step, ramps DAPO's overlong penalty over the episode's length towards
  rollout.multi_turn.max_total_tokens, and validates on whole episodes (the reward function reads them);
- `engine.reward_check` prints whole episodes: turns, tool calls, results and the episode's score.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from algorithms.advantages import get_advantage_estimator
from engine.config import ModelConfig, MultiTurnConfig
from engine.data import load_prompt_dataset, load_tokenizer
from engine.models.builder import resolve_shape
from engine.multi_turn.episode import EpisodeRunner, cut_tool_result
from engine.multi_turn.parsers import parse_hermes, register_tool_format
from engine.multi_turn.render import TurnRenderer
from engine.multi_turn.sandbox import PythonTool, namespaces_available
from engine.multi_turn.tools import (
    Calculator,
    FunctionTool,
    ToolCall,
    build_tools,
    calculate,
    call_tools,
)
from engine.rewards.embedded import calculator_score
from engine.rollout.base import SamplingParams
from engine.rollout.native import NativeRollout
from engine.step.batch import build_experience, response_lengths
from engine.tasks.embedded import build_embedded_tokenizer
from parallel.rollout_weights import RolloutWeights

sys.path.insert(0, str(Path(__file__).parent))

CPU = torch.device("cpu")


def _every_turn(text: str, tools) -> list[ToolCall]:
    """Every assistant turn calls the first tool with its text: episodes run to max_turns."""
    return [ToolCall(tools[0].name, {"expression": "6*7"})]


@pytest.fixture
def every_turn_format(monkeypatch) -> None:
    """`_every_turn` registered as tool format test_every_turn for one test. The registry is process-wide: the
    format goes into a copy that monkeypatch puts back, so no later test sees it."""
    from engine.multi_turn import parsers

    monkeypatch.setattr(parsers, "_FORMATS", dict(parsers._FORMATS))
    register_tool_format("test_every_turn")(_every_turn)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_embedded_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def _random_engine(tokenizer, max_pos: int = 96, **kw) -> NativeRollout:
    """The native engine on a seeded random tiny model (megatron parameter names and layout)."""
    shape = resolve_shape(ModelConfig(max_position_embeddings=max_pos), len(tokenizer), 1)
    g = torch.Generator().manual_seed(0)
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    qkv = (shape.num_attention_heads + 2 * shape.num_query_groups) * d

    def w(*size):
        return torch.randn(*size, generator=g) * 0.2

    params = {
        "embedding.word_embeddings.weight": w(shape.padded_vocab_size, h),
        "decoder.final_layernorm.weight": torch.ones(h),
        "output_layer.weight": w(shape.padded_vocab_size, h),
    }
    for layer in range(shape.num_layers):
        p = f"decoder.layers.{layer}."
        params |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "self_attention.linear_qkv.weight": w(qkv, h),
            p + "self_attention.linear_proj.weight": w(h, shape.num_attention_heads * d),
            p + "pre_mlp_layernorm.weight": torch.ones(h),
            p + "mlp.linear_fc1.weight": w(2 * f, h),
            p + "mlp.linear_fc2.weight": w(h, f),
        }
    engine = NativeRollout(shape, CPU, pad_id=tokenizer.pad_token_id, **kw)
    engine.set_weights(RolloutWeights(params, 1, 0, None, None, 0, 1))
    return engine


@pytest.mark.usefixtures("every_turn_format")
def test_episode_ids_are_generated_and_tool_tokens_concatenated(tokenizer):
    engine = _random_engine(tokenizer)
    cfg = MultiTurnConfig(enable=True, max_turns=3, max_total_tokens=40, tool_format="test_every_turn")
    runner = EpisodeRunner(cfg, tokenizer, {"calculator": Calculator()}, 96, tokenizer.pad_token_id)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in ("12+30", "7+8")
    ]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    eos = tokenizer.eos_token_id
    sampling = SamplingParams(n=2, temperature=0.0, max_new_tokens=6, stop_token_ids=(eos,), seed=3)
    out = runner.run(engine, prompts, sampling)
    tool_ids = TurnRenderer(tokenizer).tool_turn_ids(["42"])
    assert out.response_ids.shape == (4, 40)
    lengths = response_lengths(out.response_mask)
    for r in range(4):
        ids, mask = out.response_ids[r, : lengths[r]].tolist(), out.response_mask[r, : lengths[r]].tolist()
        episode = out.episodes[r]
        assert [t["role"] for t in episode.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
        pos, prompt = 0, prompts[r // 2]
        for turn in episode.turns:
            if turn["role"] == "tool":  # the rendered tool turn, verbatim, masked out
                assert turn["content"] == "42"
                # after a turn cut by its limit the template's stop token comes first (context as well)
                extra = 0 if ids[pos : pos + len(tool_ids)] == tool_ids else 1
                assert ids[pos + extra : pos + extra + len(tool_ids)] == tool_ids
                assert mask[pos : pos + extra + len(tool_ids)] == [0.0] * (extra + len(tool_ids))
                pos += extra + len(tool_ids)
                continue
            # the assistant turn: what greedy generation gives from exactly the ids before it
            again = engine.generate(
                [prompt + ids[:pos]],
                SamplingParams(n=1, temperature=0.0, max_new_tokens=6, stop_token_ids=(eos,)),
            )
            new = again.response_ids[0, : int(again.response_mask[0].sum())].tolist()
            assert ids[pos : pos + len(new)] == new
            assert mask[pos : pos + len(new)] == [1.0] * len(new)
            assert tokenizer.decode(new, skip_special_tokens=True) == turn["content"]
            pos += len(new)
        assert pos == len(ids)
        assert out.log_probs[r][out.response_mask[r] == 0].abs().sum() == 0
    # the training sequence keeps the tool tokens as context; the mask marks only generated ones
    exp = build_experience(prompts, out.response_ids, out.response_mask, [0, 1], 2, tokenizer.pad_token_id)
    for r in range(4):
        p, length = int(exp.prompt_lens[r]), int(lengths[r])
        assert exp.tokens[r, p : p + length].tolist() == out.response_ids[r, :length].tolist()
        assert 0 < exp.response_mask[r].sum() < length


@pytest.mark.usefixtures("every_turn_format")
def test_native_episodes_keep_the_kv_cache_across_turns(tokenizer):
    """The native engine continues each episode from its kept K/V (only the tool turn is prefilled) and the
    episodes equal those of an engine that prefills every turn in full: ids exactly, log-probs within 1e-5
    (float32), greedy and sampled with a seed; the cache is freed when the episode loop ends."""
    cfg = MultiTurnConfig(enable=True, max_turns=3, max_total_tokens=40, tool_format="test_every_turn")
    runner = EpisodeRunner(cfg, tokenizer, {"calculator": Calculator()}, 96, tokenizer.pad_token_id)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in ("12+30", "7+8", "1")
    ]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    for temperature in (0.0, 1.0):
        sampling = SamplingParams(
            n=2, temperature=temperature, max_new_tokens=6, stop_token_ids=(tokenizer.eos_token_id,), seed=3
        )
        kept = _random_engine(tokenizer, keep_cache=False)
        out = runner.run(kept, prompts, sampling)
        assert kept.last_stats["continued_rows"] == 6 and runner.last_stats["rounds"] == 3
        assert kept.pool.allocated_bytes() == 0
        ref = runner.run(_random_engine(tokenizer, keep_episode_cache=False), prompts, sampling)
        assert torch.equal(out.response_ids, ref.response_ids) and out.finish_reasons == ref.finish_reasons
        torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)


def test_advantages_with_tool_holes_keep_the_outcome():
    # row 0: 2 model tokens, 3 tool tokens, 2 model tokens; row 1: 4 model tokens
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    scores = torch.tensor([1.0, 0.0])
    adv, _ = get_advantage_estimator("grpo")(
        mask_bt=mask, scores_b=scores, group_index_b=torch.tensor([0, 0])
    )
    assert torch.allclose(adv[0, [0, 1, 5, 6]], adv[0, 0].expand(4)) and adv[0, 0] > 0
    assert (adv[0, 2:5] == 0).all()
    # GAE (gamma = lam = 1, zero values): the reward on the last model token reaches the tokens before the hole
    rewards = torch.zeros_like(mask)
    rewards[0, 6], rewards[1, 3] = 1.0, 0.0
    values = torch.full_like(mask, 0.25)
    gae, returns = get_advantage_estimator("gae")(
        mask_bt=mask, token_rewards_bt=rewards, values_bt=values, whiten=False
    )
    assert torch.allclose(gae[0, [0, 1, 5]], torch.tensor(0.75))  # 1 - V(t), the hole skipped
    assert (gae[0, 2:5] == 0).all() and (returns[0, 2:5] == 0).all()


def test_calculator_and_tool_errors_never_crash(tmp_path):
    assert calculate("12*(3+4)") == 84 and calculate("-2**3") == -8
    for bad in ("__import__('os')", "2**99999", "1/0", "a+1", "[1]"):
        with pytest.raises(ValueError):
            calculate(bad)
    mod = tmp_path / "my_tools.py"
    mod.write_text(
        "import time\n"
        "def boom(x: str):\n    raise RuntimeError('tool broke')\n"
        "def slow(x: str):\n    time.sleep(30)\n"
        "def echo(text: str):\n    '''Say it back.'''\n    return text\n"
    )
    tools = build_tools(["calculator", f"{mod}:boom", f"{mod}:slow", f"{mod}:echo"])
    assert tools["echo"].schema["function"]["parameters"]["required"] == ["text"]
    calls = [
        [ToolCall("calculator", {"expression": "6*7"}), ToolCall("echo", {"text": "hi"})],
        [ToolCall("boom", {"x": "1"}), ToolCall("slow", {"x": "1"})],
        [ToolCall("nope", {}), ToolCall("calculator", {"expression": "os.system('x')"})],
        parse_hermes(
            '<tool_call>{"name": "calculator", "arguments": "{"}</tool_call><tool_call>[1]</tool_call>', []
        ),
    ]
    start = time.perf_counter()
    results = call_tools(calls, [tools] * 4, timeout_s=1.0)
    assert time.perf_counter() - start < 5
    assert results[0] == [("42", True), ("hi", True)]
    assert results[1][0] == ("error: RuntimeError: tool broke", False)
    assert results[1][1][0].startswith("error: slow took longer than 1 s")
    assert "unknown tool 'nope'" in results[2][0][0] and results[2][1][0].startswith("error: ")
    assert all(not ok and text.startswith("error: ") for text, ok in results[3])


@pytest.mark.skipif(not namespaces_available(), reason="needs unprivileged user namespaces (unshare -r)")
def test_python_sandbox_limits_hold():
    """A well-behaved program runs first, with room to start on a loaded machine; the loop and the fork bomb
    then run side by side under a 3 s limit, which must stop both."""
    roomy = PythonTool(timeout_s=30.0)
    write = "open('inside.txt', 'w').write('x'); print(open('inside.txt').read())"
    out = {
        name: asyncio.run(roomy.call({"code": code}))
        for name, code in (("ok", "print(6*7)"), ("inside", write))
    }
    hostile = {
        "loop": "while True: pass",
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    }
    tool = PythonTool(timeout_s=3.0)

    async def run_hostile():
        return await asyncio.gather(*(tool.call({"code": c}) for c in hostile.values()))

    start = time.perf_counter()
    out.update(zip(hostile, asyncio.run(run_hostile())))
    assert time.perf_counter() - start < 15
    assert out["ok"] == "42\n" and out["inside"] == "x\n"
    assert "longer than 3 s" in out["loop"] and "longer than 3 s" in out["fork_bomb"]


@pytest.mark.skipif(
    not namespaces_available(), reason="unprivileged user namespaces (unshare -r) are not allowed here"
)
def test_python_sandbox_contains_files_and_network(tmp_path):
    outside = tmp_path / "escaped.txt"
    tool = PythonTool(timeout_s=30.0)
    programs = {
        "write_outside": f"open({str(outside)!r}, 'w').write('x')",
        "network": "import socket; socket.create_connection(('1.1.1.1', 80), timeout=1); print('CONNECTED')",
    }
    out = {name: asyncio.run(tool.call({"code": code})) for name, code in programs.items()}
    assert "Read-only file system" in out["write_outside"] and not outside.exists()
    assert not out["network"].startswith("CONNECTED") and "Network is unreachable" in out["network"]


def test_calculator_task_learns_to_call_the_tool(tmp_path):
    """The calls take off at a seed-dependent step (about 20 to 40), the reward's rise coming mostly from the
    call's shape (`#`, the `+`), the operands being copied only in part. Seeds 1-13 at 80 steps: all learned the
    call with next-fit micro-batches; with first-fit ones (the same losses up to float summation order, which
    the chaotic early steps amplify) 11 did, seeds 1 and 3 not (seed 1 by step 120). Seed 2 learned under both
    groupings, with the same metrics."""
    from trainer_jobs import CALCULATOR_TASK, read_metrics, run_job

    run_job(
        [
            *CALCULATOR_TASK,
            "data.batch_size=16",
            "rollout.n=8",
            "trainer.micro_batch_size=32",
            "algorithm.ppo_epochs=2",
            "algorithm.num_mini_batches=2",
            "optim.lr=5e-3",
            "trainer.total_steps=80",
            "trainer.seed=2",
            "trainer.progress_bar=false",
            "trainer.loggers=[jsonl]",
        ],
        str(tmp_path / "run"),
    )
    rows = read_metrics(str(tmp_path / "run"))
    reward = [r["reward/mean"] for r in rows]
    assert all(key in row for row in rows for key in MULTI_TURN_KEYS)
    calls = [r["multi_turn/tool_calls_mean"] for r in rows]
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    assert last > first + 0.03, reward
    assert sum(calls[-10:]) / 10 > 0.5 > sum(calls[:10]) / 10, calls
    assert calculator_score("#7+8\nt:15\na:15", "7+8=15") == 1.0


def test_rows_with_tools_and_dialogues_load(tmp_path, tokenizer):
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "tool", "content": "42"},
                {"role": "user", "content": "and 2+2"},
            ],
            "data_source": "embedded/calculator",
            "reward_model": {"ground_truth": "2+2=4", "style": "rule"},
            "tools": ["calculator"],
        },
        {
            "prompt": [{"role": "user", "content": "3+4"}],
            "data_source": "embedded/calculator",
            "reward_model": {"ground_truth": "3+4=7", "style": "rule"},
            "tools": None,
        },
    ]
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    schemas = {"calculator": Calculator().schema}
    records, _ = load_prompt_dataset([path], tokenizer, 64, tool_schemas=schemas)
    assert [r.tools for r in records] == [["calculator"], []]
    assert (
        tokenizer.decode(records[0].prompt_ids) == "<bos>s:be brief\nu:hi\na:hello<eos>\nt:42\nu:and 2+2\na:"
    )


def test_multi_turn_config_errors_name_the_key():
    from trainer_jobs import compose_config

    from engine.config import ConfigError
    from engine.validate import validate

    with pytest.raises(ConfigError, match="data.embedded_task"):
        validate(compose_config(["data.embedded_task=calculator"]), 1)
    with pytest.raises(ConfigError, match="rollout.multi_turn.tool_format"):
        validate(compose_config(["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_format=xml"]), 1)
    with pytest.raises(ConfigError, match="rollout.multi_turn.max_total_tokens"):
        validate(
            compose_config(["rollout.multi_turn.enable=true", "rollout.multi_turn.max_total_tokens=500"]), 1
        )
    with pytest.raises(ConfigError, match="rollout.multi_turn.tools"):
        validate(compose_config(["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[nope]"]), 1)


@pytest.mark.usefixtures("every_turn_format")
def test_long_tool_results_keep_start_and_end(tokenizer):
    text = "".join(str(i % 10) for i in range(1000))
    cut = cut_tool_result(text, 40)
    assert cut == "012345\n... 988 characters cut ...\n456789" and len(cut) == 40
    assert cut_tool_result(text[:40], 40) == text[:40] and cut_tool_result(text, 8) == text[-8:]
    assert tokenizer.unk_token_id not in tokenizer(cut, add_special_tokens=False)["input_ids"]
    # in an episode: the user tool's 200-character result, rendered within max_tool_result_chars
    cfg = MultiTurnConfig(
        enable=True, max_turns=2, max_total_tokens=60, tool_format="test_every_turn", max_tool_result_chars=36
    )
    tools = {"calculator": FunctionTool(lambda expression: "1" + "0" * 198 + "9", "calculator", "", {})}
    runner = EpisodeRunner(cfg, tokenizer, tools, 96, tokenizer.pad_token_id)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    sampling = SamplingParams(
        n=1, temperature=0.0, max_new_tokens=4, stop_token_ids=(tokenizer.eos_token_id,)
    )
    out = runner.run(_random_engine(tokenizer), [prompt], sampling)
    tool_turn = out.episodes[0].turns[1]
    assert tool_turn == {"role": "tool", "content": "1000\n... 192 characters cut ...\n0009"}


MULTI_TURN_KEYS = (
    "multi_turn/episodes",
    "multi_turn/turns_mean",
    "multi_turn/tool_calls_mean",
    "multi_turn/tool_error_frac",
    "multi_turn/tool_s",
)
TURNS_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info):
    # the episode's turns, plus one when the decoded episode holds the tool turn's text
    return float(len(extra_info["turns"])) + float("t:42" in solution_str)
"""
EVERY_TURN_JOB = [
    "data.embedded_task=copy",
    "data.embedded_digits=2",
    "rollout.multi_turn.enable=true",
    "rollout.multi_turn.tool_format=test_every_turn",
    "rollout.multi_turn.tools=[calculator]",
    "rollout.multi_turn.max_turns=2",
    "rollout.max_new_tokens=4",
]
"""Every assistant turn calls the calculator (`6*7`): episodes are assistant, tool `42`, assistant."""


@pytest.mark.usefixtures("every_turn_format")
def test_multi_turn_job_metrics_overlong_penalty_and_validation(tmp_path):
    """World size 1, 2 steps of 4 prompts x 4 episodes, validation at step 2."""
    from trainer_jobs import read_metrics, run_job

    fn = tmp_path / "turns_reward.py"
    fn.write_text(TURNS_REWARD)
    out = str(tmp_path / "run")
    trainer = run_job(
        [
            *EVERY_TURN_JOB,
            "rollout.multi_turn.max_total_tokens=18",
            "algorithm.overlong_buffer_len=4",
            f"reward.fn={fn}:score",
            "trainer.test_freq=2",
        ],
        out,
    )
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # 16 episodes a step, each of 2 assistant turns and 1 successful call
        assert {k: row[k] for k in MULTI_TURN_KEYS[:4]} == dict(zip(MULTI_TURN_KEYS, (16.0, 2.0, 1.0, 0.0)))
        assert row["multi_turn/tool_s"] >= 0 and not any(k.startswith("rollout_engine/episode") for k in row)
    # the overlong penalty ramps over the last 4 of the episode's 18 tokens (tool tokens counted)
    exp = trainer.last_experience
    lengths = response_lengths(exp.response_mask)
    expected = -(lengths - 14).clamp(0, 4) / 4.0
    assert torch.equal(exp.tensors["overlong_penalty"], expected.float()), (lengths, exp.tensors)
    assert (lengths > 14).any() and (exp.response_mask.sum(-1) < lengths).all()
    # verl's clip ratio: episodes as long as the budget, 18, their tool tokens counted; a last turn cut by
    # rollout.max_new_tokens short of it counts as truncated only
    clipped = float((lengths == 18).float().mean())
    assert rows[-1]["response_length/clip_ratio"] == pytest.approx(clipped)
    assert rows[-1]["response_length/truncated_ratio"] > clipped
    # validation rolled out whole episodes and scored them as such: 3 turns, the tool turn in the text
    assert rows[-1]["val/reward_mean"] == 4.0 and rows[-1]["val/reward_std"] == 0.0


@pytest.mark.usefixtures("every_turn_format")
def test_reward_check_shows_whole_episodes(tmp_path, capsys):
    from engine.tools.reward_check import main

    fn = tmp_path / "turns_reward.py"
    fn.write_text(TURNS_REWARD)
    saved = dict(os.environ)  # init_distributed exports MASTER_PORT & co
    try:
        status = main(
            [
                "reward_check.num_samples=2",
                "reward_check.num_rows=1",
                *EVERY_TURN_JOB,
                "rollout.multi_turn.max_total_tokens=24",
                f"reward.fn={fn}:score",
                f"trainer.output_dir={tmp_path}",
            ]
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
    printed = capsys.readouterr().out
    assert status == 0, printed
    episodes = printed.split("[prompt 0, sample ")[1:]
    assert len(episodes) == 2, printed
    for episode in episodes:
        lines = episode.splitlines()
        assert lines[0].endswith("] score=4.0000"), lines
        assert lines[1] == "episode: 2 assistant turn(s), 1 tool call(s), 0 failed"
        assert lines[2].startswith("  [assistant] ")
        assert lines[3] == '    -> call calculator({"expression": "6*7"})'
        assert lines[4] == "  [tool] 42" and lines[5].startswith("  [assistant] ")
