"""engine.data: parquet validation, chat-templated ids, length filter, tokenizer loading, the DP prompt loader."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from engine.data import (
    chat_prompt_ids,
    load_prompt_dataset,
    load_tokenizer,
    read_prompt_rows,
    refuse_row_caps,
)
from engine.tasks.embedded import build_embedded_tokenizer

TEMPLATE_OVERHEAD = len("<bos>u:") - len("<bos>") + 1 + len("\na:")  # tokens the embedded template adds: 6


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_embedded_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def make_row(content="copy 12", source="embedded/copy", truth="12", extra=None):
    return {
        "prompt": [{"role": "user", "content": content}],
        "data_source": source,
        "reward_model": {"ground_truth": truth, "style": "rule"},
        "extra_info": extra if extra is not None else {"index": 0},
    }


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def test_load_records_and_indices_across_files(tmp_path, tokenizer):
    a = write(tmp_path / "a.parquet", [make_row(f"copy {i}", truth=str(i)) for i in range(3)])
    b = write(tmp_path / "b.parquet", [make_row("copy 77", source="gsm8k", truth="77")])
    records, counts = load_prompt_dataset([a, b], tokenizer, max_prompt_len=64)
    assert counts == {"rows": 4, "kept": 4, "too_long": 0, "bad": 0}
    assert [r.index for r in records] == [0, 1, 2, 3]
    assert records[3].data_source == "gsm8k" and records[3].ground_truth == "77"
    assert records[0].extra_info == {"index": 0}
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "copy 77"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert records[3].prompt_ids == expected


def test_too_long_filtered_and_counted(tmp_path, tokenizer):
    lengths = [2, 10, 4, 11, 3]
    path = write(tmp_path / "x.parquet", [make_row("a" * n) for n in lengths])
    records, counts = load_prompt_dataset([path], tokenizer, max_prompt_len=4 + TEMPLATE_OVERHEAD)
    assert counts == {"rows": 5, "kept": 3, "too_long": 2, "bad": 0}
    assert [r.index for r in records] == [0, 2, 4]  # indices stay the dataset positions
    assert all(len(r.prompt_ids) == n + TEMPLATE_OVERHEAD for r, n in zip(records, [2, 4, 3]))
    with pytest.raises(
        ValueError, match=r"no prompt left.*shortest prompt has 8 tokens.*data.max_prompt_len"
    ):
        load_prompt_dataset([path], tokenizer, max_prompt_len=7)


def test_val_prompts_not_used_are_reported(tmp_path, tokenizer, capsys):
    """data.val_files' prompts over data.max_prompt_len and bad rows skipped are printed as the training
    files' are (engine.setup.load_prompts, used by the training ranks and the rollout ranks of split
    placement), on the logging rank only; no prompt is left out for the DP shares."""
    from engine.config import TrainConfig
    from engine.setup import load_prompts

    cfg = TrainConfig()
    cfg.data.max_prompt_len, cfg.data.bad_rows = 4 + TEMPLATE_OVERHEAD, "skip"
    rows = [make_row("a" * n) for n in (2, 10, 4, 3, 3, 3)] + [make_row(truth=None)]
    path = write(tmp_path / "val.parquet", rows)
    records = load_prompts(cfg, [path], tokenizer, None, "data.val_files", log=True)
    assert len(records) == 5  # one too long, one bad
    assert capsys.readouterr().out == (
        "data: kept 5 of 7 prompts of data.val_files (1 over data.max_prompt_len, 1 bad rows skipped)\n"
    )
    load_prompts(cfg, [path], tokenizer, None, "data.val_files", log=False)
    assert capsys.readouterr().out == ""


def test_every_val_prompt_is_scored_once_over_dp_replicas():
    """Each replica runs as many validation prompts (repeats even out the shares) and scores its own ones
    only: over every replica, each prompt exactly once, per data source (engine/setup.py
    `replica_val_batches`, engine/step/validation.py `scored_prompts`)."""
    import torch

    from engine.setup import replica_val_batches, replica_val_prompts
    from engine.step.validation import scored_prompts

    for n in range(0, 10):
        records = [f"p{i}" for i in range(n)]
        for dp in (1, 2, 3, 4):
            for per_rank in (1, 2, 5):
                scored, sizes = [], set()
                for rank in range(dp):
                    batches = replica_val_batches(records, dp, rank, per_rank)
                    sizes.add(tuple(len(b) for b in batches))
                    per_prompt = [(b, {"reward": torch.tensor([int(p[1:]) for p in b])}) for b in batches]
                    kept = scored_prompts(per_prompt, replica_val_prompts(n, dp, rank))
                    for sources, values in kept:
                        assert [int(p[1:]) for p in sources] == values["reward"].tolist()
                        scored += sources
                assert sorted(scored) == sorted(records), (n, dp, per_rank, scored)
                assert len(sizes) == 1, (n, dp, per_rank, sizes)  # the same batches on every replica


def _set(path_keys, value):
    def mutate(row):
        target = row
        for key in path_keys[:-1]:
            target = target[key]
        target[path_keys[-1]] = value

    return mutate


MALFORMED = [
    ("prompt null", _set(["prompt"], None), "prompt"),
    ("prompt empty", _set(["prompt"], []), "prompt"),
    ("content null", lambda row: row["prompt"][0].update(content=None), r"prompt\[0\].content"),
    ("role null", lambda row: row["prompt"][0].update(role=None), r"prompt\[0\].role"),
    ("data_source null", _set(["data_source"], None), "data_source"),
    ("data_source empty", _set(["data_source"], ""), "data_source"),
    ("reward_model null", _set(["reward_model"], None), "reward_model"),
    ("ground_truth null", _set(["reward_model", "ground_truth"], None), r"reward_model.ground_truth"),
]


@pytest.mark.parametrize("case, mutate, field", MALFORMED, ids=[case[0] for case in MALFORMED])
def test_malformed_row_names_file_row_field(tmp_path, tokenizer, case, mutate, field):
    rows = [make_row() for _ in range(4)]
    mutate(rows[2])
    good = write(tmp_path / "good.parquet", [make_row()])
    bad = write(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match=rf"data.train_files\[1\]={bad}: row 2: field '{field}'.*Fix:"):
        load_prompt_dataset([good, bad], tokenizer, max_prompt_len=64)
    records, counts = load_prompt_dataset([good, bad], tokenizer, max_prompt_len=64, bad_rows="skip")
    assert counts == {"rows": 5, "kept": 4, "too_long": 0, "bad": 1}
    assert [r.index for r in records] == [0, 1, 2, 4]


def test_whole_column_problems(tmp_path):
    as_string = [dict(make_row(), prompt="copy 12") for _ in range(2)]
    with pytest.raises(ValueError, match=r"row 0: field 'prompt' is a plain string"):
        read_prompt_rows([write(tmp_path / "s.parquet", as_string)])
    extra_str = [dict(make_row(), extra_info="x") for _ in range(2)]
    with pytest.raises(ValueError, match=r"row 0: field 'extra_info'"):
        read_prompt_rows([write(tmp_path / "e.parquet", extra_str)])
    no_source = [{k: v for k, v in make_row().items() if k != "data_source"}]
    path = write(tmp_path / "n.parquet", no_source)
    for mode in ("error", "skip"):  # a missing column is a schema mistake: never silently skip a file
        with pytest.raises(ValueError, match=r"data.val_files\[0\]=.*\['data_source'\] missing"):
            read_prompt_rows([path], bad_rows=mode, files_key="data.val_files")


def test_optional_and_coerced_fields(tmp_path):
    rows = [{k: v for k, v in make_row(truth=None).items() if k != "extra_info"} for _ in range(2)]
    for i, row in enumerate(rows):
        row["reward_model"]["ground_truth"] = 42 + i
    parsed, counts = read_prompt_rows([write(tmp_path / "x.parquet", rows)])
    assert [row.ground_truth for row in parsed] == ["42", "43"] and parsed[0].extra_info == {}


def test_float_ground_truths_read_as_the_answer_a_rule_compares(tmp_path, tokenizer):
    """A float answer column (pandas' type for integer answers once one is missing or fractional): 72.0 is
    "72", which GSM8K's strict rule matches; 2.5 stays "2.5"; NaN and infinity name the row."""
    from engine.rewards.gsm8k import gsm8k_score

    truths = pa.array([72.0, 3.0, 2.5, -4.0], pa.float64())
    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": "copy 1"}]] * 4,
            "data_source": ["openai/gsm8k"] * 4,
            "reward_model": pa.StructArray.from_arrays([truths], names=["ground_truth"]),
        }
    )
    path = str(tmp_path / "f.parquet")
    pq.write_table(table, path)
    assert pq.read_schema(path).field("reward_model").type.field("ground_truth").type == pa.float64()
    records, _ = load_prompt_dataset([path], tokenizer, max_prompt_len=64)
    assert [r.ground_truth for r in records] == ["72", "3", "2.5", "-4"]
    assert gsm8k_score("#### 72", records[0].ground_truth) == 1.0
    narrow = table.set_column(  # a float32 column: 0.1 is "0.1", not float64's "0.10000000149011612"
        2,
        "reward_model",
        pa.StructArray.from_arrays([pa.array([0.1, 2.5, 72.0, -4.0], pa.float32())], ["ground_truth"]),
    )
    pq.write_table(narrow, path)
    records, _ = load_prompt_dataset([path], tokenizer, max_prompt_len=64)
    assert [r.ground_truth for r in records] == ["0.1", "2.5", "72", "-4"]
    for bad in (float("nan"), float("inf")):
        rows = [make_row(truth=1.5), make_row(truth=bad)]
        with pytest.raises(ValueError, match=r"row 1: field 'reward_model.ground_truth' is (nan|inf).*Fix:"):
            read_prompt_rows([write(tmp_path / "bad.parquet", rows)])


# A tool-calling template in the style of Qwen2.5's / Llama 3.1's: it asks whether a message has the key,
# so a `tool_calls: None` left in by a parquet struct column would fail (iterating None).
TOOL_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] or '' }}"
    "{% if 'reasoning_content' in m %}#{{ m['reasoning_content'] }}{% endif %}"
    "{% if 'tool_calls' in m %}{% for c in m['tool_calls'] %}"
    "={{ c['function']['name'] }}:{{ c['function']['arguments'] }}{% endfor %}{% endif %}"
    "{% if 'name' in m %}={{ m['name'] }},{{ m['tool_call_id'] }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def test_messages_keep_tool_calls_and_drop_null_keys(tmp_path):
    """A dialogue so far with an assistant tool call and its result renders as the template renders the
    messages (keys a parquet struct column fills with null left out); a malformed tool_calls names the row."""
    tok = load_tokenizer(build_embedded_tokenizer(str(tmp_path / "tok")))
    tok.chat_template = TOOL_TEMPLATE
    call = {"type": "function", "function": {"name": "calc", "arguments": "1+2"}}
    messages = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "", "reasoning_content": "easy", "tool_calls": [call]},
        {"role": "tool", "content": "3", "name": "calc", "tool_call_id": "c1"},
        {"role": "user", "content": "so"},
    ]
    path = write(tmp_path / "t.parquet", [make_row(), dict(make_row(), prompt=messages)])
    rows, _ = read_prompt_rows([path])
    assert rows[0].messages == [{"role": "user", "content": "copy 12"}]  # no null keys of the struct
    assert rows[1].messages == messages
    records, _ = load_prompt_dataset([path], tok, max_prompt_len=128)
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert records[1].prompt_ids == expected
    assert tok.decode(expected) == "u:add\na:#easy=calc:1+2\nt:3=calc,c1\nu:so\na:"
    for bad, field in (
        ({"tool_calls": "calc"}, "tool_calls"),
        ({"name": 3}, "name"),
        ({"content": None}, "content"),  # null content is an assistant's tool call only
    ):
        broken = [messages[0], {**messages[1], "tool_calls": None, **bad}]
        with pytest.raises(ValueError, match=rf"row 0: field 'prompt\[1\].{field}'.*Fix:"):
            read_prompt_rows([write(tmp_path / "bad.parquet", [dict(make_row(), prompt=broken)])])
    # OpenAI's format: an assistant turn that only calls tools has content null; kept, rendered as the template does
    calls_only = [messages[0], {**messages[1], "content": None}, *messages[2:]]
    path = write(tmp_path / "null.parquet", [dict(make_row(), prompt=calls_only)])
    (row,), _ = read_prompt_rows([path])
    assert row.messages == calls_only
    (record,), _ = load_prompt_dataset([path], tok, max_prompt_len=128)
    expected = tok.apply_chat_template(
        calls_only, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert record.prompt_ids == expected
    assert tok.decode(expected) == "u:add\na:#easy=calc:1+2\nt:3=calc,c1\nu:so\na:"


def test_file_list_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data.train_files is empty"):
        read_prompt_rows([])
    missing = str(tmp_path / "missing.parquet")
    with pytest.raises(FileNotFoundError, match=rf"data.train_files\[0\]={missing}: file not found"):
        read_prompt_rows([missing])
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(ValueError, match=r"cannot read as parquet"):
        read_prompt_rows([str(junk)])
    with pytest.raises(ValueError, match=r"bad_rows='drop'"):
        read_prompt_rows([missing], bad_rows="drop")


class FakeTokenizer:
    chat_template = "x"

    def __init__(self, kind):
        self.kind = kind

    def apply_chat_template(self, conversations, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        ids = [[7] * len(c) for c in conversations]
        return {"dict": {"input_ids": ids}, "list": ids, "tensor": torch.tensor(ids)}[self.kind]


@pytest.mark.parametrize("kind", ["dict", "list", "tensor"])
def test_chat_prompt_ids_accepts_transformers_return_types(kind):
    convs = [[{"role": "user", "content": "a"}] * 2, [{"role": "user", "content": "b"}] * 2]
    assert chat_prompt_ids(FakeTokenizer(kind), convs) == [[7, 7], [7, 7]]


def test_no_chat_template_is_a_clear_error():
    tok = FakeTokenizer("list")
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat_template"):
        chat_prompt_ids(tok, [[{"role": "user", "content": "a"}]])


def test_load_tokenizer_errors_and_pad(tmp_path):
    with pytest.raises(ValueError, match=r"model.path='.*nowhere': not a directory"):
        load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"model.tokenizer_path=.*no tokenizer files"):
        load_tokenizer(str(tmp_path), key="model.tokenizer_path")
    core = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1, "a": 2}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>").save_pretrained(
        tmp_path / "t"
    )
    tok = load_tokenizer(str(tmp_path / "t"))
    assert tok.eos_token_id == 1 and tok.pad_token_id == 1


def test_empty_tokenizer_path_means_the_tokenizer_of_model_path(tmp_path):
    """model.tokenizer_path empty: model.path's tokenizer, the embedded task included; a model.path without
    tokenizer files is a validation error naming the directory and the fix (not the character tokenizer)."""
    import hf_tiny

    from engine.config import ConfigError, TrainConfig
    from engine.setup import _data_files
    from engine.validate import validate

    model = hf_tiny.save_tiny("qwen2", str(tmp_path / "model"))
    cfg = TrainConfig()
    cfg.model.path = model
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=1)
    message = str(err.value)
    assert f"model.path={model!r}" in message and f"{model} has no tokenizer files" in message, message
    assert "Fix: save the model's tokenizer into" in message and "model.tokenizer_path" in message, message
    assert _data_files(cfg, str(tmp_path / "out"))[0] == model  # setup loads it, whose error says the same

    own = build_embedded_tokenizer(str(tmp_path / "tok"))
    cfg.model.tokenizer_path = own  # a named tokenizer: model.path needs none
    validate(cfg, world_size=1)
    assert _data_files(cfg, str(tmp_path / "out"))[0] == own
    cfg.model.tokenizer_path = ""
    build_embedded_tokenizer(model)  # now model.path has a tokenizer: the embedded task uses it
    validate(cfg, world_size=1)
    assert _data_files(cfg, str(tmp_path / "out"))[0] == model
    cfg.model.path = ""  # random init: the embedded character tokenizer, written under the output dir
    assert _data_files(cfg, str(tmp_path / "out"))[0] == str(tmp_path / "out" / "embedded" / "tokenizer")


def test_files_as_single_string(tmp_path):
    path = write(tmp_path / "x.parquet", [make_row()])
    assert os.path.exists(path) and len(read_prompt_rows(path)[0]) == 1


def test_empty_file_is_named(tmp_path, tokenizer):
    good = write(tmp_path / "good.parquet", [make_row()])
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist([make_row()]).slice(0, 0), str(empty))
    for files in ([str(empty)], [good, str(empty)]):
        with pytest.raises(
            ValueError, match=rf"data.train_files\[{len(files) - 1}\]={empty}: the file has no rows"
        ):
            load_prompt_dataset(files, tokenizer, max_prompt_len=64)


def test_directory_reads_its_parquet_files_sorted(tmp_path, tokenizer):
    shards = tmp_path / "shards"
    shards.mkdir()
    write(shards / "b.parquet", [make_row("copy 2", truth="2")])
    write(shards / "a.parquet", [make_row("copy 1", truth="1")])
    (shards / "README.txt").write_text("not data")
    single = write(tmp_path / "c.parquet", [make_row("copy 3", truth="3")])
    records, counts = load_prompt_dataset([str(shards), single], tokenizer, max_prompt_len=64)
    assert [r.ground_truth for r in records] == ["1", "2", "3"] and counts["rows"] == 3
    bad = [dict(make_row(), data_source="")]
    write(shards / "c.parquet", bad)
    with pytest.raises(
        ValueError, match=rf"data.train_files\[0\]={shards}: c.parquet: row 0: field 'data_source'"
    ):
        read_prompt_rows([str(shards)])
    empty_dir = tmp_path / "nothing"
    empty_dir.mkdir()
    with pytest.raises(
        ValueError, match=rf"data.val_files\[1\]={empty_dir}: a directory with no \*.parquet files"
    ):
        read_prompt_rows([single, str(empty_dir)], files_key="data.val_files")


def test_max_new_tokens_column_caps_rows_and_bad_caps_name_the_row(tmp_path, tokenizer):
    """The optional `max_new_tokens` column: a row's cap (null = none) reaches its record; a cap over
    rollout.max_new_tokens, below 1 or not a whole number is an error naming the file, the row and the fix;
    multi-turn runs refuse caps (refuse_row_caps)."""
    rows = [make_row(f"copy {i}", truth=str(i)) for i in range(3)]
    capped = [{**row, "max_new_tokens": cap} for row, cap in zip(rows, (5, None, 2))]
    path = write(tmp_path / "caps.parquet", capped)
    records, _ = load_prompt_dataset([path], tokenizer, max_prompt_len=64, max_new_tokens=8)
    assert [r.max_new_tokens for r in records] == [5, None, 2]
    plain, _ = load_prompt_dataset([write(tmp_path / "plain.parquet", rows)], tokenizer, max_prompt_len=64)
    assert [r.max_new_tokens for r in plain] == [None] * 3
    for cap, problem in ((9, "is 9, more than rollout.max_new_tokens=8"), (0, "is 0, below 1")):
        bad = write(tmp_path / f"bad{cap}.parquet", [*capped[:2], {**rows[2], "max_new_tokens": cap}])
        with pytest.raises(ValueError, match=rf"bad{cap}.parquet: row 2: field 'max_new_tokens' {problem}"):
            load_prompt_dataset([bad], tokenizer, max_prompt_len=64, max_new_tokens=8)
    text = write(tmp_path / "text.parquet", [{**rows[0], "max_new_tokens": "5"}])
    with pytest.raises(ValueError, match=r"row 0: field 'max_new_tokens' is str '5', expected an integer"):
        read_prompt_rows([text], max_new_tokens=8)
    refuse_row_caps(plain, "data.train_files")
    with pytest.raises(
        ValueError, match=r"data.val_files: 2 row\(s\) \(dataset positions \[0, 2\]\) set max_new"
    ):
        refuse_row_caps(records, "data.val_files")


def test_responses_stop_at_every_eos_of_the_generation_config(tmp_path):
    """An instruct checkpoint names one eos in its tokenizer and more in generation_config.json (Qwen2.5:
    <|im_end|> and <|endoftext|>): the rollout stops at each, as transformers' generate and vLLM do (it
    stopped at the tokenizer's alone and ran every response to the token limit)."""
    import json

    from config_compose import composed

    from engine.data import load_tokenizer, stop_token_ids
    from engine.errors import DataError
    from engine.step.rollout import rollout_params

    tok = load_tokenizer(build_embedded_tokenizer(str(tmp_path / "model")))
    eos = tok.eos_token_id
    assert stop_token_ids(tok, str(tmp_path / "model")) == (eos,)  # no generation_config.json
    for written, want in (([eos + 1, eos], (eos, eos + 1)), (eos + 2, (eos, eos + 2)), (None, (eos,))):
        model = tmp_path / f"m{written}"
        model.mkdir()
        (model / "generation_config.json").write_text(json.dumps({"eos_token_id": written}))
        assert stop_token_ids(tok, str(model)) == want
    params = rollout_params(composed(), stop_token_ids(tok, str(tmp_path / f"m{[eos + 1, eos]}")), 0, [])
    assert {kind: p.stop_token_ids for kind, p in params.items()} == dict.fromkeys(params, (eos, eos + 1))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    with pytest.raises(
        DataError, match=r"generation_config.json: eos_token_id='<\|im_end\|>' is not a token id"
    ):
        stop_token_ids(tok, str(bad))
