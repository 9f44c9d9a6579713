"""The embedded default task: a character-level tokenizer and digit tasks built offline, in seconds.

`python -m engine.train` with no arguments trains a tiny random-init model on CPU; it needs a task that
such a model visibly learns within minutes:
- "copy": the prompt shows K random digits and asks to repeat them; answer = the K digits.
- "target": the prompt names one digit d; answer = d repeated K times (learnt in seconds; for short tests).
- "calculator" (multi-turn, with a tool): the prompt is a sum of two K-digit numbers, "48+39"; the model calls
  the calculator in the compact tool format (`#48+39`, engine/multi_turn/parsers.py), reads the result in the
  tool turn (`t:87`) and answers with it (`87`). The episode text scored is `#48+39\nt:87\na:87`; ground truth
  "48+39=87". Reward (`engine.rewards.embedded`): half for the call (the expression copied, position by
  position), half for the final answer, nothing without a call; both are copies at a fixed distance, which a tiny model learns, while
  the sum itself is beyond it.
Reward: fraction of positions correct (`engine.rewards.embedded`), partial credit so learning shows early.

Everything is written in the formats real runs use (a Hugging Face tokenizer directory with a chat
template, RLHF-schema parquet), so the default job exercises the same data path as a real model.
Files are written to a temporary name and renamed into place, so several ranks may build the same
directory at once. This module must not import the trainer or anything that touches the network.
"""

from __future__ import annotations

import os
import random
import string
import tempfile
from dataclasses import dataclass

EMBEDDED_TASKS = ("copy", "target", "calculator")
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# One token per character; ids are stable (specials first), so a saved model stays valid across versions.
EMBEDDED_VOCAB = (
    *SPECIAL_TOKENS,
    *string.digits,
    *string.ascii_lowercase,
    *" :=,.?#+-\n",
)

# Roles are shown by their first letter to keep prompts short: "<bos>u:copy 123456\na:" is 17 tokens.
# Finished assistant turns end with <eos>, the token the rollout stops on. The newline is an expression
# because transformers renders templates with trim_blocks (a literal newline after `%}` is dropped).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'][0] }}:{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def embedded_prompt(task: str, answer: str) -> str:
    """The user message for one row of `task` whose expected answer is `answer`."""
    if task == "copy":
        return f"copy {answer}"
    if task == "target":
        return f"repeat {answer[0]}"
    if task == "calculator":
        return answer.split("=")[0]
    raise ValueError(f"unknown embedded task {task!r}; choose one of {list(EMBEDDED_TASKS)}")


def build_embedded_tokenizer(out_dir: str) -> str:
    """Build the character-level tokenizer offline and save it as a HF tokenizer directory; returns out_dir.

    Vocabulary: `EMBEDDED_VOCAB` (50 entries); characters outside it encode as `<unk>`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(EMBEDDED_VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own word ("\n" included, which `.` would not match).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        tokenizer.save_pretrained(tmp)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    return out_dir


def write_embedded_dataset(
    out_dir: str,
    task: str = "copy",
    num_rows: int = 4096,
    digits: int = 6,
    seed: int = 0,
    split: str = "train",
) -> str:
    """Write `num_rows` rows of `task` with answers of `digits` digits as RLHF parquet; returns the file path.

    Row i: prompt [{"role": "user", "content": embedded_prompt(...)}], data_source "embedded/<task>",
    reward_model {"ground_truth": <digit string>, "style": "rule"}, extra_info {split, index, num_digits}.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if task not in EMBEDDED_TASKS:
        raise ValueError(f"unknown embedded task {task!r}; choose one of {list(EMBEDDED_TASKS)}")
    if digits < 1 or num_rows < 1:
        raise ValueError(f"embedded dataset needs digits >= 1 and num_rows >= 1, got {digits=}, {num_rows=}")
    rng = random.Random(f"{task}:{digits}:{seed}")
    rows = []
    for index in range(num_rows):
        if task == "copy":
            answer = "".join(rng.choice(string.digits) for _ in range(digits))
        elif task == "calculator":
            a, b = (rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits) for _ in range(2))
            answer = f"{a}+{b}={a + b}"
        else:
            answer = rng.choice(string.digits) * digits
        rows.append(
            {
                "prompt": [{"role": "user", "content": embedded_prompt(task, answer)}],
                "data_source": f"embedded/{task}",
                "ability": task,
                "reward_model": {"ground_truth": answer, "style": "rule"},
                "extra_info": {"split": split, "index": index, "num_digits": digits},
            }
        )
    schema = pa.schema(
        [
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("data_source", pa.string()),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            (
                "extra_info",
                pa.struct([("split", pa.string()), ("index", pa.int64()), ("num_digits", pa.int64())]),
            ),
        ]
    )
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"embedded_{task}_{split}_k{digits}_n{num_rows}_s{seed}.parquet")
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".build-", suffix=".parquet")
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp makes the file private; the data should read like any other file
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class EmbeddedJob:
    """Paths of one prepared embedded task."""

    tokenizer_dir: str
    """HF tokenizer directory (use as the tokenizer path; the model is random-init)."""
    train_file: str
    """Parquet file for `data.train_files`."""
    val_file: str
    """Parquet file for `data.val_files` (different seed, same task)."""


def prepare_embedded_job(
    out_dir: str,
    task: str = "copy",
    digits: int = 6,
    num_train_rows: int = 4096,
    num_val_rows: int = 256,
    seed: int = 0,
) -> EmbeddedJob:
    """Build the tokenizer and the train/val parquet files of `task` under `out_dir`."""
    tokenizer_dir = build_embedded_tokenizer(os.path.join(out_dir, "tokenizer"))
    train_file = write_embedded_dataset(os.path.join(out_dir, "data"), task, num_train_rows, digits, seed)
    val_file = write_embedded_dataset(
        os.path.join(out_dir, "data"), task, num_val_rows, digits, seed + 1, "val"
    )
    return EmbeddedJob(tokenizer_dir, train_file, val_file)
