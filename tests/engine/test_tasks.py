"""The embedded task: tokenizer built offline, chat template round trip, parquet rows, oracle scores 1.0."""

import pyarrow.parquet as pq
import pytest

from engine.data import chat_prompt_ids, load_prompt_dataset, load_tokenizer
from engine.rewards.build import build_reward_fn
from engine.tasks.embedded import (
    EMBEDDED_VOCAB,
    build_embedded_tokenizer,
    prepare_embedded_job,
    write_embedded_dataset,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_embedded_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def test_tokenizer_is_small_char_level_with_specials(tokenizer):
    assert len(tokenizer) == len(EMBEDDED_VOCAB) < 64
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    ids = tokenizer.encode("copy 12:3,\nx", add_special_tokens=False)
    assert len(ids) == len("copy 12:3,\nx")  # one token per character, newline included
    assert tokenizer.decode(ids) == "copy 12:3,\nx"


def test_chat_template_round_trip(tokenizer):
    messages = [{"role": "user", "content": "copy 123456"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos>u:copy 123456\na:"
    ids = chat_prompt_ids(tokenizer, [messages])[0]
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert 10 <= len(ids) <= 20
    history = messages + [{"role": "assistant", "content": "123456"}]
    assert tokenizer.apply_chat_template(history, tokenize=False).endswith("a:123456<eos>\n")


@pytest.mark.parametrize("task", ["copy", "target"])
def test_dataset_rows_and_oracle(tmp_path, tokenizer, task):
    path = write_embedded_dataset(str(tmp_path), task=task, num_rows=20, digits=4, seed=3)
    assert write_embedded_dataset(str(tmp_path), task=task, num_rows=20, digits=4, seed=3) == path
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 20
    truths = [row["reward_model"]["ground_truth"] for row in rows]
    assert all(len(t) == 4 and t.isdigit() for t in truths)
    if task == "target":
        assert all(
            len(set(t)) == 1 and row["prompt"][0]["content"] == f"repeat {t[0]}"
            for t, row in zip(truths, rows)
        )
    else:
        assert all(row["prompt"][0]["content"] == f"copy {t}" for t, row in zip(truths, rows))
    records, counts = load_prompt_dataset([path], tokenizer, max_prompt_len=32)
    assert counts == {"rows": 20, "kept": 20, "too_long": 0, "bad": 0}
    assert {r.data_source for r in records} == {f"embedded/{task}"}
    scores = build_reward_fn("")([r.data_source for r in records], truths, truths)
    assert scores.tolist() == [1.0] * 20


def test_seed_changes_data_and_prepare_job(tmp_path):
    a = pq.read_table(write_embedded_dataset(str(tmp_path), "copy", 8, 6, seed=0)).to_pylist()
    b = pq.read_table(write_embedded_dataset(str(tmp_path), "copy", 8, 6, seed=1)).to_pylist()
    assert a != b
    job = prepare_embedded_job(str(tmp_path / "job"), num_train_rows=16, num_val_rows=4)
    assert pq.read_metadata(job.train_file).num_rows == 16 and pq.read_metadata(job.val_file).num_rows == 4
    assert load_tokenizer(job.tokenizer_dir).eos_token == "<eos>"


def test_unknown_task(tmp_path):
    with pytest.raises(ValueError, match="unknown embedded task 'sort'"):
        write_embedded_dataset(str(tmp_path), task="sort")
