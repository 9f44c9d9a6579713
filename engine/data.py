"""Prompts for RL: RLHF-schema parquet -> chat-templated token ids (the per-DP-rank batches:
engine/prompt_loader.py).

Schema of a row (the one verl and most RLHF datasets use):
- `prompt`: list of chat messages `{"role": str, "content": str}`, optionally with the keys chat templates
  render: `tool_calls` (a list of dicts), `name`, `tool_call_id`, `reasoning_content` (strings); content may
  be null in a message with tool_calls (OpenAI's format for a turn that only calls tools); another key whose
  value is null is left out (a struct column gives every message every key)
- `data_source`: str, picks the rule reward (`engine.rewards`)
- `reward_model`: `{"ground_truth": str, "style": str}` (numbers are accepted and turned into strings: an
  integer or a float with an integral value as the integer, 72.0 -> "72", as pandas writes integer answers
  in a float column; other floats as Python writes them, 2.5 -> "2.5"; NaN and infinity are refused)
- `extra_info`: free dict, optional (the column may be missing; null reads as {})
- `tools`: list of tool names, optional (multi-turn rollouts: the tools of rollout.multi_turn.tools this
  row's episodes may call; missing, null or empty = all of them)
- `max_new_tokens`: int, optional (the column may be missing; null = no cap): the most tokens each response
  to this prompt may have (a per-prompt budget), in [1, rollout.max_new_tokens]; the rollout passes it as
  `SamplingParams.max_new_tokens_per_prompt` (training and validation rollouts, every backend). Responses
  that reach it end with finish reason "length", as at rollout.max_new_tokens (so they count in
  `response_length/truncated_ratio`, but not in `response_length/clip_ratio`, which is verl's: responses of
  rollout.max_new_tokens tokens); DAPO's overlong penalty still ramps towards rollout.max_new_tokens, not the
  row's cap. Single-turn rollouts only.
The conversation may have several messages of any roles (system, user, assistant, tool: a dialogue so far).
Prompts are tokenised with the tokenizer's own chat template, exactly as
`tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` does.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine import data_rows
from engine.errors import DataError, DataFileNotFoundError

REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BAD_ROWS_MODES = ("error", "skip")
_CHAT_TEMPLATE_CHUNK = 256  # rows per apply_chat_template call: batched is faster, chunks bound memory


@dataclass
class PromptRow:
    """One validated, not yet tokenised row."""

    messages: list[dict[str, Any]]
    data_source: str
    ground_truth: str
    extra_info: dict
    index: int
    """Position in the dataset (all files in order, before any filtering): stable across runs."""
    tools: list[str] = field(default_factory=list)
    """Tool names of the row's `tools` column (empty: all configured tools)."""
    max_new_tokens: int | None = None
    """The row's `max_new_tokens` column: its responses' most tokens (None: rollout.max_new_tokens)."""


@dataclass
class PromptRecord:
    """One prompt ready for rollout."""

    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: dict = field(default_factory=dict)
    index: int = 0
    """Position in the dataset (all files in order, before any filtering): stable across runs."""
    tools: list[str] = field(default_factory=list)
    """Tools the prompt's multi-turn episodes may call, by name (empty: all of rollout.multi_turn.tools)."""
    max_new_tokens: int | None = None
    """Most tokens of each response to this prompt (the row's `max_new_tokens`; None: rollout.max_new_tokens)."""


def _expand_files(files: Sequence[str], files_key: str) -> list[tuple[str, str]]:
    """(where, path) for each parquet file: a directory stands for its `*.parquet` files, sorted by name."""
    out = []
    for file_i, path in enumerate(map(str, files)):
        where = f"{files_key}[{file_i}]={path}"
        if not os.path.isdir(path):
            out.append((where, path))
            continue
        names = sorted(name for name in os.listdir(path) if name.endswith(".parquet"))
        inside = [name for name in names if os.path.isfile(os.path.join(path, name))]
        if not inside:
            raise DataError(
                f"{where}: a directory with no *.parquet files. Fix: put the parquet files in it, or list the "
                f"files themselves, e.g. {files_key}=[/data/train.parquet]"
            )
        out.extend((f"{where}: {name}", os.path.join(path, name)) for name in inside)
    return out


def check_files_exist(files: Sequence[str], files_key: str) -> None:
    """Raise DataFileNotFoundError naming the first of `files` (`files_key`) that does not exist (a file or
    a directory of them): engine/validate runs it before any process group exists."""
    for file_i, path in enumerate(map(str, files)):
        if not os.path.exists(path):
            _not_found(f"{files_key}[{file_i}]={path}")


def _not_found(where: str) -> None:
    raise DataFileNotFoundError(
        f"{where}: file not found. Fix: pass existing parquet files, e.g. {where.split('[')[0]}=[/data/train.parquet]"
    )


def _read_columns(path: str, where: str) -> dict[str, list]:
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        _not_found(where)
    try:
        names = pq.read_schema(path).names
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(f"{where}: cannot read as parquet ({type(exc).__name__}: {exc})") from exc
    missing = [name for name in REQUIRED_COLUMNS if name not in names]
    if missing:
        raise DataError(
            f"{where}: column(s) {missing} missing (all rows); found {names}. Fix: write the RLHF schema "
            "(prompt, data_source, reward_model, optional extra_info)"
        )
    optional = ("extra_info", "tools", "max_new_tokens")
    wanted = [*REQUIRED_COLUMNS, *(name for name in optional if name in names)]
    table = pq.read_table(path, columns=wanted)
    if table.num_rows == 0:
        raise DataError(
            f"{where}: the file has no rows. Fix: write the prompts into it, or remove it from "
            f"{where.split('[')[0]}"
        )
    columns = {name: table.column(name).to_pylist() for name in wanted}
    _keep_float_width(table, columns["reward_model"])
    columns.setdefault("extra_info", [None] * table.num_rows)
    columns.setdefault("tools", [None] * table.num_rows)
    columns.setdefault("max_new_tokens", [None] * table.num_rows)
    return columns


def _keep_float_width(table, reward_models: list) -> None:
    """A float32/float16 ground_truth column comes out of `to_pylist` as Python (64-bit) floats: 0.1 as
    0.10000000149011612. Give those values back their own type, so that engine/data_rows.py writes the
    shortest decimal of their precision ("0.1")."""
    import pyarrow as pa

    kind = table.schema.field("reward_model").type
    if not pa.types.is_struct(kind) or kind.get_field_index("ground_truth") < 0:
        return
    narrow = {pa.float32(): np.float32, pa.float16(): np.float16}.get(kind.field("ground_truth").type)
    if narrow is None:
        return
    for value in reward_models:
        if isinstance(value, dict) and isinstance(value.get("ground_truth"), float):
            value["ground_truth"] = narrow(value["ground_truth"])


def read_prompt_rows(
    files: Sequence[str],
    bad_rows: str = "error",
    files_key: str = "data.train_files",
    max_new_tokens: int | None = None,
) -> tuple[list[PromptRow], dict[str, int]]:
    """Read and validate the rows of `files` (parquet, RLHF schema), in order; no tokenisation.

    Returns the valid rows and counts {"rows", "bad"}. A malformed row raises ValueError naming the file,
    the row and the field (bad_rows="error"), or is skipped and counted (bad_rows="skip"). A directory in
    `files` stands for the `*.parquet` files in it, sorted by name. A missing file, a file with no rows, a
    directory with no parquet file, an empty file list or a missing required column always raises, naming
    `files_key` and the file. `max_new_tokens` (rollout.max_new_tokens): the largest per-row cap allowed
    in the `max_new_tokens` column (None: any positive one).
    """
    if bad_rows not in BAD_ROWS_MODES:
        raise DataError(f"bad_rows={bad_rows!r}: must be one of {list(BAD_ROWS_MODES)}")
    if isinstance(files, str):
        files = [files]
    if not files:
        raise DataError(
            f"{files_key} is empty: give at least one parquet file, e.g. {files_key}=[/data/train.parquet]"
        )
    rows: list[PromptRow] = []
    counts = {"rows": 0, "bad": 0}
    for where, path in _expand_files(files, files_key):
        columns = _read_columns(path, where)
        for row_i, (prompt, source, reward_model, extra, tools, cap) in enumerate(
            zip(
                columns["prompt"],
                columns["data_source"],
                columns["reward_model"],
                columns["extra_info"],
                columns["tools"],
                columns["max_new_tokens"],
            )
        ):
            index = counts["rows"]
            counts["rows"] += 1
            try:
                row = PromptRow(
                    messages=data_rows.check_prompt(prompt),
                    data_source=data_rows.check_data_source(source),
                    ground_truth=data_rows.check_ground_truth(reward_model),
                    extra_info=data_rows.check_extra_info(extra),
                    index=index,
                    tools=data_rows.check_tools(tools),
                    max_new_tokens=data_rows.check_max_new_tokens(cap, max_new_tokens),
                )
            except data_rows.BadRow as bad:
                if bad_rows == "skip":
                    counts["bad"] += 1
                    continue
                raise DataError(
                    f"{where}: row {row_i}: field '{bad.field_name}' {bad.problem}. Fix: {bad.fix}; "
                    "or load with bad_rows='skip' to skip and count such rows"
                ) from None
            rows.append(row)
    return rows, counts


def chat_prompt_ids(
    tokenizer, conversations: Sequence[list[dict[str, str]]], tools: list[dict] | None = None
) -> list[list[int]]:
    """Token ids of each conversation with the generation prompt, as transformers' apply_chat_template gives;
    `tools`: function schemas the template renders (multi-turn), the same for every conversation."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat_template. Fix: use a chat/instruct "
            "checkpoint, or add a chat_template (chat_template.jinja) to the tokenizer directory"
        )
    extra = {"tools": tools} if tools else {}
    out = tokenizer.apply_chat_template(
        list(conversations), add_generation_prompt=True, tokenize=True, **extra
    )
    # transformers 5 returns a BatchEncoding (dict-like) by default, 4.x a plain list; accept both.
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    ids = [list(map(int, seq.tolist() if hasattr(seq, "tolist") else seq)) for seq in out]
    if len(ids) != len(conversations):
        raise RuntimeError(
            f"apply_chat_template returned {len(ids)} sequences for {len(conversations)} conversations"
        )
    return ids


def load_prompt_dataset(
    files: Sequence[str],
    tokenizer,
    max_prompt_len: int,
    bad_rows: str = "error",
    files_key: str = "data.train_files",
    tool_schemas: dict[str, dict] | None = None,
    max_new_tokens: int | None = None,
) -> tuple[list[PromptRecord], dict[str, int]]:
    """Read, validate and chat-template the prompts of `files`; drop prompts over `max_prompt_len` tokens.
    `tool_schemas` (multi-turn: {name: function schema}): each prompt is rendered with the schemas of the
    tools its row names (all of them when it names none), for templates that show tools to the model.
    `max_new_tokens` (rollout.max_new_tokens): the largest per-row cap allowed (`read_prompt_rows`).

    Returns (records, counts) with counts {"rows", "kept", "too_long", "bad"}. Raises ValueError as
    `read_prompt_rows` does, and when no prompt is left.
    """
    files = [files] if isinstance(files, str) else list(map(str, files))
    rows, counts = read_prompt_rows(files, bad_rows, files_key, max_new_tokens)
    records: list[PromptRecord] = []
    too_long, shortest = 0, None
    for start in range(0, len(rows), _CHAT_TEMPLATE_CHUNK):
        chunk = rows[start : start + _CHAT_TEMPLATE_CHUNK]
        for row, ids in zip(chunk, _chunk_ids(tokenizer, chunk, tool_schemas)):
            shortest = len(ids) if shortest is None else min(shortest, len(ids))
            if len(ids) > max_prompt_len:
                too_long += 1
                continue
            records.append(
                PromptRecord(
                    ids,
                    row.data_source,
                    row.ground_truth,
                    row.extra_info,
                    row.index,
                    row.tools,
                    row.max_new_tokens,
                )
            )
    counts = {"rows": counts["rows"], "kept": len(records), "too_long": too_long, "bad": counts["bad"]}
    if not records:
        hint = (
            f"; the shortest prompt has {shortest} tokens: raise data.max_prompt_len (now {max_prompt_len})"
            if too_long
            else ""
        )
        raise DataError(f"{files_key}={files}: no prompt left after loading ({counts}){hint}")
    return records, counts


def refuse_row_caps(records: Sequence[PromptRecord], files_key: str) -> None:
    """Multi-turn rollouts have no per-row response caps: refuse rows that set `max_new_tokens`."""
    capped = [r.index for r in records if r.max_new_tokens is not None]
    if capped:
        raise DataError(
            f"{files_key}: {len(capped)} row(s) (dataset positions {capped[:5]}) set max_new_tokens, which "
            "multi-turn rollouts (rollout.multi_turn.enable) do not honour. Fix: write null in that column or "
            "drop it (rollout.multi_turn.max_total_tokens bounds an episode), or turn multi-turn off"
        )


def _chunk_ids(tokenizer, rows: list[PromptRow], tool_schemas: dict[str, dict] | None) -> list[list[int]]:
    """Chat-templated ids of the rows: in one call, or with tools one call per row that names its own."""
    if not tool_schemas:
        return chat_prompt_ids(tokenizer, [row.messages for row in rows])
    every = list(tool_schemas.values())
    out = [None] * len(rows)
    plain = [i for i, row in enumerate(rows) if not row.tools]
    for i, ids in zip(
        plain, chat_prompt_ids(tokenizer, [rows[i].messages for i in plain], every) if plain else []
    ):
        out[i] = ids
    for i, row in enumerate(rows):
        if row.tools:
            schemas = [tool_schemas[name] for name in row.tools if name in tool_schemas]
            out[i] = chat_prompt_ids(tokenizer, [row.messages], schemas)[0]
    return out


def load_tokenizer(path: str, key: str = "model.path"):
    """Load a Hugging Face tokenizer from a local directory (never the network); set pad = eos if unset.

    The eos id is `tokenizer.eos_token_id` (guaranteed set). Raises ValueError naming `key` and `path`.
    """
    if not path or not os.path.isdir(path):
        raise DataError(
            f"{key}={path!r}: not a directory. Fix: point {key} at a local Hugging Face checkpoint directory"
        )
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise DataError(
            f"{key}={path}: no tokenizer files (looked for {list(TOKENIZER_FILES)}). Fix: save the model's "
            "tokenizer there (tokenizer.save_pretrained), or set model.tokenizer_path to a directory that has one"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise DataError(f"{key}={path}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from exc
    if tokenizer.eos_token_id is None:
        raise DataError(
            f"{key}={path}: the tokenizer has no eos token. Fix: set eos_token in tokenizer_config.json"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer, model_dir: str = "") -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's eos, then every `eos_token_id` of `model_dir`'s
    generation_config.json (an int or a list), as transformers' `generate` and vLLM stop at all of them.
    Instruct checkpoints end a turn with one id and a document with another (Qwen2.5: <|im_end|> and
    <|endoftext|>; Llama-3-Instruct: <|eot_id|> and <|end_of_text|>), and the tokenizer names only one:
    stopping at it alone would run each response past its end to the token limit."""
    return (
        tokenizer.eos_token_id,
        *(i for i in _generation_eos_ids(model_dir) if i != tokenizer.eos_token_id),
    )


@functools.cache
def _generation_eos_ids(model_dir: str) -> tuple[int, ...]:
    path = os.path.join(model_dir, "generation_config.json") if model_dir else ""
    if not path or not os.path.isfile(path):
        return ()
    try:
        with open(path) as f:
            ids = json.load(f).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{path}: cannot read it ({type(exc).__name__}: {exc}). Fix: repair or remove the file"
        ) from exc
    ids = [ids] if ids is None or isinstance(ids, int) else ids
    if not isinstance(ids, list) or not all(i is None or (isinstance(i, int) and i >= 0) for i in ids):
        raise DataError(f"{path}: eos_token_id={ids!r} is not a token id or a list of them. Fix: write ints")
    return tuple(dict.fromkeys(i for i in ids if i is not None))
