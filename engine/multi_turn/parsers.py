"""Tool-call formats: how calls are found in the text of an assistant turn (`rollout.multi_turn.tool_format`).

- `hermes` (Hermes / Qwen2.5 / Qwen3 chat templates): every `<tool_call>{json}</tool_call>` block, the JSON
  holding `name` and `arguments` (an object, or a string holding one).
- `compact` (for tiny character-level tokenizers that lack `<`, `{` and quotes, like the embedded one): a turn
  whose text starts with `#` is one call of the turn's first tool, the rest of the turn (stripped) being the
  value of that tool's first parameter; `#calculator:12+30` would pass `calculator:12+30` as the argument.

A parser returns the turn's calls in order (none: the episode ends with this turn); a malformed call is
returned with its `error` set, and the model reads that error as the tool's result. Register more with
`register_tool_format`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from engine.multi_turn.tools import Tool, ToolCall

ToolParser = Callable[[str, list[Tool]], list[ToolCall]]
"""(turn text, the episode's tools in order) -> calls."""

_FORMATS: dict[str, ToolParser] = {}


def register_tool_format(name: str) -> Callable[[ToolParser], ToolParser]:
    def wrap(fn: ToolParser) -> ToolParser:
        _FORMATS[name] = fn
        return fn

    return wrap


def tool_format_names() -> list[str]:
    return sorted(_FORMATS)


def get_tool_parser(name: str) -> ToolParser:
    if name not in _FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {tool_format_names()}")
    return _FORMATS[name]


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@register_tool_format("hermes")
def parse_hermes(text: str, tools: list[Tool]) -> list[ToolCall]:
    calls = []
    for block in _HERMES.findall(text):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({exc.msg} at {exc.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'a tool call must be {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "the tool call's arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


@register_tool_format("compact")
def parse_compact(text: str, tools: list[Tool]) -> list[ToolCall]:
    if not text.startswith("#"):
        return []
    if not tools:
        return [ToolCall("", {}, "no tool is available in this episode")]
    tool = tools[0]
    names = list(tool.parameters.get("properties", {}))
    if not names:
        return [ToolCall(tool.name, {})]
    return [ToolCall(tool.name, {names[0]: text[1:].strip()})]
