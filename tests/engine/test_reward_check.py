"""The engine.reward_check CLI: scoring given responses on real rows, and its dry run that generates with the
configured model and rollout engine as training does."""

import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import subprocess_env
from test_rewards import REPO, USER_MODULE


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_MODULE)
    return str(path)


def _gsm8k_parquet(path):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "data_source": "openai/gsm8k",
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"index": i},
        }
        for i, (a, b) in enumerate([(1000, 234), (2, 3), (4, 5)])
    ]
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def test_reward_check_cli(tmp_path):
    data = _gsm8k_parquet(tmp_path / "gsm.parquet")
    proc = subprocess.run(
        [sys.executable, "-m", "engine.reward_check", f"data.train_files=[{data}]", "reward_check.num_rows=2",
         'reward_check.responses=["#### 5","no idea"]'],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert ["0", "openai/gsm8k", "oracle", "####", "1234", "1.0000"] in lines
    assert ["1", "openai/gsm8k", "given", "####", "5", "1.0000"] in lines
    assert ["1", "openai/gsm8k", "given", "no", "idea", "0.0000"] in lines
    assert "row 0: What is 1000 + 234?" in proc.stdout
    assert not any(line[:1] == ["2"] for line in lines)  # num_rows=2

    bad = subprocess.run(
        [sys.executable, "-m", "engine.reward_check", f"data.train_files=[{data}]", "reward.fn=nowhere_mod:f"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "reward.fn='nowhere_mod:f'" in bad.stderr


def test_reward_check_in_process_with_tokenizer_and_user_fn(tmp_path, user_file, capsys):
    from engine.tasks.embedded import build_embedded_tokenizer, write_embedded_dataset
    from engine.tools.reward_check import main

    tok = build_embedded_tokenizer(str(tmp_path / "tok"))
    data = write_embedded_dataset(str(tmp_path), "copy", num_rows=3, digits=4, seed=0)
    args = [f"data.train_files={data}", f"model.tokenizer_path={tok}", "data.max_prompt_len=14"]
    assert main([*args, f"reward.fn={user_file}:score"]) == 0
    out = capsys.readouterr().out
    assert "(15 tokens; longer than data.max_prompt_len, dropped)" in out
    assert out.count("oracle") == 3 and "1.0000" in out
    assert main([*args, f"reward.fn={user_file}:nan", 'reward_check.responses=["bad"]']) == 1
    assert "ERROR RewardFnCallError: reward.fn=" in capsys.readouterr().out
    assert main(["data.trainfiles=[x]"]) == 2
    assert "bad argument 'data.trainfiles=[x]'" in capsys.readouterr().err


def test_reward_check_generates_and_scores(tmp_path, user_file):
    """The dry run builds the configured (random-init) model and native engine, samples K responses per
    prompt and prints each with its score and the reward function's extra keys."""
    args = [
        "reward_check.num_samples=3",
        'reward_check.sample_prompt="copy 1234"',
        "reward_check.data_source=embedded/copy",
        "reward_check.ground_truth=1234",
        f"reward.fn={user_file}:with_extra",
        "rollout.max_new_tokens=5",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "engine.reward_check", *args],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, env=subprocess_env(PYTHONPATH=REPO),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 prompt(s) x 3 samples, rollout.backend=native" in proc.stdout
    assert "=== prompt 0 (data_source='embedded/copy'): " in proc.stdout and "copy 1234" in proc.stdout
    scores = re.findall(r"\[prompt 0, sample (\d)\] score=(\d\.\d{4})  length=(\d+)", proc.stdout)
    assert [s[0] for s in scores] == ["0", "1", "2"], proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "engine.reward_check", "reward_check.num_samples=2", "parallel.tp=3"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, env=subprocess_env(PYTHONPATH=REPO),
    )  # fmt: skip
    assert bad.returncode == 2 and "parallel.tp" in bad.stderr


def test_reward_check_caps_each_row_at_its_max_new_tokens(tmp_path, user_file):
    """The dry run samples as training does: a row's `max_new_tokens` caps its responses (it used to sample
    every row to rollout.max_new_tokens), and a cap above rollout.max_new_tokens is refused, naming the row."""
    from engine.tasks.embedded import build_embedded_tokenizer

    tok = build_embedded_tokenizer(str(tmp_path / "tok"))
    data = str(tmp_path / "caps.parquet")
    rows = {
        "prompt": [[{"role": "user", "content": "copy 12"}]] * 2,
        "data_source": ["embedded/copy"] * 2,
        "reward_model": [{"ground_truth": "12", "style": "rule"}] * 2,
        "max_new_tokens": [2, 6],
    }
    pq.write_table(pa.table(rows), data)
    args = [
        "reward_check.num_samples=3",
        "reward_check.num_rows=2",
        f"data.train_files=[{data}]",
        f"model.tokenizer_path={tok}",
        f"reward.fn={user_file}:with_extra",
        "rollout.ignore_eos=true",
    ]

    def check(limit: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "engine.reward_check", *args, f"rollout.max_new_tokens={limit}"],
            capture_output=True, text=True, cwd=tmp_path, timeout=300, env=subprocess_env(PYTHONPATH=REPO),
        )  # fmt: skip

    proc = check(8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lengths = {
        (int(p), int(s)): int(n)
        for p, s, n in re.findall(r"\[prompt (\d), sample (\d)\] .*length=(\d+)", proc.stdout)
    }
    assert len(lengths) == 6, proc.stdout
    # one character per token; a sampled special token decodes to nothing, so a response may come out shorter
    assert all(lengths[0, s] <= 2 for s in range(3)) and all(lengths[1, s] <= 6 for s in range(3)), lengths
    assert max(lengths[1, s] for s in range(3)) > 2, lengths
    over = check(4)
    assert over.returncode != 0 and "row 1" in over.stderr and "rollout.max_new_tokens=4" in over.stderr, (
        over.stderr
    )
