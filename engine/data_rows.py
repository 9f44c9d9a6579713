"""The checks of one row of the prompt schema (engine/data.py's module docstring lists the fields): each
returns the field's value in the form the loader keeps, or raises `BadRow` naming the field, what is wrong
with it and the fix (the loader adds the file and the row)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def check_tools(value: Any) -> list[str]:
    if value is None:
        return []
    if (
        isinstance(value, str)
        or not isinstance(value, Sequence)
        or not all(isinstance(t, str) for t in value)
    ):
        raise BadRow(
            "tools", f"is {describe(value)}, expected a list of tool names", 'write e.g. ["calculator"]'
        )
    return list(value)


def check_max_new_tokens(value: Any, limit: int | None) -> int | None:
    if value is None:
        return None
    fix = f"write a whole number of tokens in [1, rollout.max_new_tokens={limit}], or null for no cap"
    if limit is None:
        fix = "write a whole number of tokens >= 1, or null for no cap"
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise BadRow("max_new_tokens", f"is {describe(value)}, expected an integer", fix)
    if value < 1 or (limit is not None and value > limit):
        where = "below 1" if value < 1 else f"more than rollout.max_new_tokens={limit}"
        raise BadRow("max_new_tokens", f"is {int(value)}, {where}", fix)
    return int(value)


class BadRow(Exception):
    def __init__(self, field_name: str, problem: str, fix: str):
        super().__init__(field_name)
        self.field_name, self.problem, self.fix = field_name, problem, fix


PROMPT_FIX = 'prompt must be a list of messages like [{"role": "user", "content": "..."}]'
MESSAGE_TEXT_KEYS = ("name", "tool_call_id", "reasoning_content")
"""Optional string keys of a message that chat templates render (a tool result's name and call id, an
assistant turn's reasoning); `tool_calls` (an assistant turn's list of calls) is the other one kept."""


def check_prompt(value: Any) -> list[dict[str, Any]]:
    """The messages with role, content and the optional keys templates render (`MESSAGE_TEXT_KEYS`,
    `tool_calls`); content may be None in a message with tool_calls (as the templates of tool-calling models
    expect it); an optional key whose value is None is left out, since a parquet struct column gives every message
    every key of the column (a template asking `'tool_calls' in message` would see `tool_calls: None`)."""
    if value is None:
        raise BadRow("prompt", "is missing (null)", PROMPT_FIX)
    if isinstance(value, str):
        raise BadRow("prompt", "is a plain string, not a list of chat messages", PROMPT_FIX)
    if not isinstance(value, Sequence) or len(value) == 0:
        raise BadRow("prompt", f"is {describe(value)}, expected a non-empty list of messages", PROMPT_FIX)
    messages = []
    for j, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise BadRow(f"prompt[{j}]", f"is {describe(message)}, expected a dict", PROMPT_FIX)
        for key in ("role", "content"):
            if key == "content" and message.get(key) is None and message.get("tool_calls") is not None:
                continue  # an assistant turn that only calls tools: OpenAI's format writes content null
            if not isinstance(message.get(key), str):
                raise BadRow(
                    f"prompt[{j}].{key}", f"is {describe(message.get(key))}, expected a string", PROMPT_FIX
                )
        messages.append(
            {"role": message["role"], "content": message.get("content"), **_optional_keys(message, j)}
        )
    return messages


def _optional_keys(message: Mapping, j: int) -> dict[str, Any]:
    out = {}
    for key in MESSAGE_TEXT_KEYS:
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise BadRow(
                    f"prompt[{j}].{key}", f"is {describe(message[key])}, expected a string", PROMPT_FIX
                )
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls is not None:
        if (
            isinstance(calls, str)
            or not isinstance(calls, Sequence)
            or not all(isinstance(c, Mapping) for c in calls)
        ):
            fix = 'write tool_calls as a list of calls like [{"type": "function", "function": {...}}]'
            raise BadRow(f"prompt[{j}].tool_calls", f"is {describe(calls)}, expected a list of dicts", fix)
        out["tool_calls"] = [dict(call) for call in calls]
    return out


def check_data_source(value: Any) -> str:
    if not isinstance(value, str) or not value:
        fix = 'set data_source to the dataset name that picks the reward, e.g. "openai/gsm8k"'
        raise BadRow("data_source", f"is {describe(value)}, expected a non-empty string", fix)
    return value


def check_ground_truth(value: Any) -> str:
    fix = 'reward_model must be {"ground_truth": "<answer>", "style": "rule"}'
    if not isinstance(value, Mapping):
        raise BadRow("reward_model", f"is {describe(value)}, expected a dict", fix)
    truth = value.get("ground_truth")
    if isinstance(truth, str):
        return truth
    if isinstance(truth, (int, np.integer)) and not isinstance(truth, bool):
        return str(int(truth))
    if isinstance(truth, (float, np.floating)):
        return _float_truth(truth, fix)
    raise BadRow("reward_model.ground_truth", f"is {describe(truth)}, expected a string", fix)


def _float_truth(truth: float | np.floating, fix: str) -> str:
    """A float answer as the string a rule compares: pandas stores integer answers as floats once one value of
    the column is missing or fractional, so 72.0 is the answer "72" (str would give "72.0", which GSM8K's
    strict rule never matches); a fractional one is the shortest decimal of its own precision ("2.5"; a
    float32 column's 0.1 is "0.1", not float64's "0.10000000149011612")."""
    value = float(truth)
    if not math.isfinite(value):
        raise BadRow(
            "reward_model.ground_truth",
            f"is {value!r}, not an answer (a float column's missing value reads as NaN)",
            f"{fix}; fill in or drop the row's answer",
        )
    if value.is_integer():
        return str(int(value))
    if isinstance(truth, np.floating):
        return np.format_float_positional(truth, unique=True, trim="-")
    return repr(value)


def check_extra_info(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadRow(
            "extra_info", f"is {describe(value)}, expected a dict or null", "store extra_info as a dict"
        )
    return dict(value)


def describe(value: Any) -> str:
    if value is None:
        return "missing (null)"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"
