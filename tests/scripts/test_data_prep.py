"""scripts/data/gsm8k.py and math_dataset.py on tiny local copies of the hub datasets (written here), and a
`task=gsm8k` training run on what they write."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from distributed import subprocess_env

from engine.data import read_prompt_rows
from engine.rewards.build import build_reward_fn
from engine.rewards.registry import find_rule

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCHEMA = ["data_source", "prompt", "ability", "reward_model", "extra_info"]
GSM8K = {
    "train": [
        {"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
        {"question": "Tom has 1,200 apples.", "answer": "He has 1,200.\n#### 1,200"},
        {"question": "Debt?", "answer": "#### -7"},
    ],
    "test": [{"question": "What is 4 + 4?", "answer": "#### 8"}],
}
MATH = {
    "train": [
        {"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
        {"problem": "Cost?", "solution": "First \\boxed{3}, then \\boxed{\\$18.90}", "level": "Level 2"},
    ],
    "test": [{"problem": "1+1?", "solution": "\\boxed{2}", "level": "Level 1"}],
}


def _hub_copy(root, subdir, splits):
    for split, rows in splits.items():
        os.makedirs(os.path.join(root, subdir), exist_ok=True)
        pq.write_table(
            pa.Table.from_pylist(rows), os.path.join(root, subdir, f"{split}-00000-of-00001.parquet")
        )
    return str(root)


def _prepare(script, source, out):
    proc = subprocess.run(
        [sys.executable, f"scripts/data/{script}", "--source", source, "--out", out],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_gsm8k_rows_as_verl_writes_them(tmp_path):
    source = _hub_copy(tmp_path / "hub", "main", GSM8K)
    out = str(tmp_path / "gsm8k")
    assert "train: 3 rows" in _prepare("gsm8k.py", source, out)
    table = pq.read_table(os.path.join(out, "train.parquet"))
    assert table.column_names == SCHEMA
    rows = table.to_pylist()
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    assert rows[1] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Tom has 1,200 apples. " + instruction}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1200"},
        "extra_info": {"split": "train", "index": 1, "answer": "He has 1,200.\n#### 1,200", "question": "Tom has 1,200 apples."},
    }  # fmt: skip
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["5", "1200", "-7"]
    test_rows = pq.read_table(os.path.join(out, "test.parquet")).to_pylist()
    assert (
        test_rows[0]["extra_info"]["split"] == "test" and test_rows[0]["reward_model"]["ground_truth"] == "8"
    )
    # the engine reads them and its GSM8K rule scores the oracle answer 1.0
    read, counts = read_prompt_rows([os.path.join(out, "train.parquet")], "error")
    assert counts["rows"] == 3 and read[2].ground_truth == "-7"
    rule = find_rule(read[0].data_source)
    fn = build_reward_fn("")
    oracle = [rule.oracle(r.ground_truth) for r in read]
    assert fn([r.data_source for r in read], oracle, [r.ground_truth for r in read]).tolist() == [1.0] * 3


def test_math_rows_as_verl_writes_them(tmp_path):
    source = _hub_copy(tmp_path / "hub", "data", MATH)
    out = str(tmp_path / "math")
    _prepare("math_dataset.py", source, out)
    table = pq.read_table(os.path.join(out, "train.parquet"))
    assert table.column_names == SCHEMA
    rows = table.to_pylist()
    assert rows[0] == {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": "Half of 1? Let's think step by step and output the final answer within \\boxed{}."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
        "extra_info": {"split": "train", "index": 0},
    }  # fmt: skip
    assert rows[1]["reward_model"]["ground_truth"] == "\\$18.90"  # the last box
    assert find_rule(rows[0]["data_source"]).name == "boxed_math"


def test_missing_source_files_name_the_pattern(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/data/gsm8k.py", "--source", str(tmp_path), "--out", str(tmp_path / "o")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1 and "main/train-*.parquet" in proc.stderr and "Traceback" not in proc.stderr


def test_task_gsm8k_trains_on_prepared_data(tmp_path):
    from engine.tasks.embedded import build_embedded_tokenizer

    out = str(tmp_path / "gsm8k")
    _prepare("gsm8k.py", _hub_copy(tmp_path / "hub", "main", GSM8K), out)
    composed = subprocess.run(
        [sys.executable, "-m", "engine.train", "task=gsm8k", "--cfg", "job"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "~/data/gsm8k/train.parquet" in composed.stdout and "max_new_tokens: 1024" in composed.stdout
    tok = build_embedded_tokenizer(str(tmp_path / "tok"))  # character-level: any question encodes
    run_dir = str(tmp_path / "run")
    args = [
        "task=gsm8k", f"data.train_files=[{out}/train.parquet]", f"data.val_files=[{out}/test.parquet]",
        f"model.tokenizer_path={tok}", "data.max_prompt_len=128", "rollout.max_new_tokens=4", "rollout.n=2",
        "data.batch_size=2", "trainer.micro_batch_size=4", "trainer.total_steps=1", "trainer.test_freq=1", f"trainer.output_dir={run_dir}",
        "trainer.progress_bar=false",
    ]  # fmt: skip
    env = subprocess_env()
    proc = subprocess.run(
        [sys.executable, "-m", "engine.train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        record = json.loads(f.readlines()[-1])
    assert record["step"] == 1 and "val/reward_mean" in record and "reward/mean" in record
