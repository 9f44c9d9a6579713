"""Tools an episode may call: the interface, the built-in calculator and Python executor, user tools by
`module:function`, and `call_tools`, which runs one turn's calls so that no tool can crash a step.

A tool has a `name`, a JSON `schema` (the OpenAI function format that chat templates render) and
`async call(args) -> str`. A failing, slow or malformed call becomes an `error: ...` string, which the model
reads as the tool's result. Built-in tools are registered by name (`TOOLS`); `rollout.multi_turn.tools`
lists names and `module:function` specs.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import UserError
from engine.multi_turn.tool import Tool
from engine.user_code import import_target, split_target


class ToolSpecError(UserError, ValueError):
    """A tool named in rollout.multi_turn.tools that cannot be built; the message names the spec and a fix."""

    exit_status = 2


# ---- calculator: arithmetic parsed with `ast`, never evaluated as code ------------------------------------

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_EXPRESSION_CHARS = 200


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); ValueError otherwise.

    Only number literals and those operators are accepted (no names, calls or attributes), and exponents are
    bounded, so no input can run code or exhaust memory."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} too large (at most {_MAX_EXPONENT})")
            return _BINARY[type(node.op)](left, right)
        raise ValueError(f"unsupported element {type(node).__name__} in {expression!r}")

    try:
        return value(tree.body)
    except ZeroDivisionError as exc:
        raise ValueError("division by zero") from exc


def format_number(x: int | float) -> str:
    """Integers (and integral floats) without a decimal point, other floats to 6 significant digits."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.6g}"


class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
        "required": ["expression"],
    }

    async def call(self, args: dict) -> str:
        return format_number(calculate(str(args["expression"])))


# ---- user tools --------------------------------------------------------------------------------------------


@dataclass
class FunctionTool(Tool):
    """A user function as a tool: `fn(**args) -> str` (plain or async); its schema comes from its signature
    (every parameter a string unless annotated int/float/bool) and its docstring's first line, or from a
    `schema` attribute on the function (an OpenAI function schema) when it has one."""

    fn: Callable = field(default=None)
    name: str = ""
    description: str = ""
    parameters: dict = field(default_factory=dict)

    @classmethod
    def from_function(cls, fn: Callable) -> FunctionTool:
        given = getattr(fn, "schema", None)
        if isinstance(given, dict) and "function" in given:
            f = given["function"]
            return cls(fn, f["name"], f.get("description", ""), f.get("parameters", {}))
        kinds = {int: "integer", float: "number", bool: "boolean", "int": "integer", "float": "number"}
        params = inspect.signature(fn).parameters
        properties = {p: {"type": kinds.get(v.annotation, "string")} for p, v in params.items()}
        required = [p for p, v in params.items() if v.default is inspect.Parameter.empty]
        doc = (inspect.getdoc(fn) or "").split("\n")[0]
        schema = {"type": "object", "properties": properties, "required": required}
        return cls(fn, fn.__name__, doc, schema)

    async def call(self, args: dict) -> str:
        if inspect.iscoroutinefunction(self.fn):
            return str(await self.fn(**args))
        return str(await _in_daemon_thread(self.fn, args))


def _in_daemon_thread(fn: Callable, args: dict) -> asyncio.Future:
    """Run a plain function in a daemon thread: the wall-clock limit of `call_tools` applies to it, and a call
    that never returns is abandoned (a thread cannot be killed) without blocking the loop's exit or the
    interpreter's."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, exc) -> None:
        if not future.done():
            future.set_exception(exc) if exc is not None else future.set_result(result)

    def target() -> None:
        try:
            result, exc = fn(**args), None
        except BaseException as e:  # handed to the awaiting coroutine
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop closed after a timeout: nobody waits for this result
            pass

    threading.Thread(target=target, daemon=True, name=f"tool-{getattr(fn, '__name__', 'fn')}").start()
    return future


def _import_attr(spec: str, key: str):
    parts = split_target(spec)
    if parts is None:
        raise ToolSpecError(
            f"{key}: {spec!r} is neither a built-in tool ({sorted(TOOLS)}) nor 'module:function' / "
            "'path/to/file.py:function'. Fix: name a built-in tool or a function after a colon"
        )
    target, name = parts
    try:
        module = import_target(target, "engine_user_tool_")
    except Exception as exc:
        raise ToolSpecError(
            f"{key}: cannot import {target!r} for tool {spec!r} ({type(exc).__name__}: {exc}). Fix: put the "
            "module on PYTHONPATH or give an existing file path"
        ) from exc
    fn = getattr(module, name, None)
    if fn is None:
        raise ToolSpecError(
            f"{key}: {target} has no attribute {name!r} (tool {spec!r}). Fix: name a function"
        )
    return fn


def build_tool(spec: str, key: str = "rollout.multi_turn.tools", **options) -> Tool:
    """A built-in tool by name (`TOOLS`, built with `options` it accepts), or a user tool by `module:function`
    (a `Tool` instance, a `Tool` subclass, or a function)."""
    if spec in TOOLS:
        factory = TOOLS[spec]
        accepted = inspect.signature(factory).parameters
        return factory(**{k: v for k, v in options.items() if k in accepted})
    obj = _import_attr(spec, key)
    if isinstance(obj, Tool):
        return obj
    if inspect.isclass(obj) and issubclass(obj, Tool):
        return obj()
    if callable(obj):
        return FunctionTool.from_function(obj)
    raise ToolSpecError(f"{key}: {spec!r} is not a function or Tool. Fix: point it at a function")


def build_tools(specs, key: str = "rollout.multi_turn.tools", **options) -> dict[str, Tool]:
    """{name: tool} of the specs; two tools with one name are an error."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = build_tool(spec, key, **options)
        if tool.name in tools:
            raise ToolSpecError(f"{key}: two tools are named {tool.name!r}. Fix: keep one of them")
        tools[tool.name] = tool
    return tools


def _python_tool(timeout_s: float = 10.0, sandbox_memory_mb: int = 512) -> Tool:
    from engine.multi_turn.sandbox import PythonTool

    return PythonTool(timeout_s=timeout_s, memory_mb=sandbox_memory_mb)


TOOLS: dict[str, Callable[..., Tool]] = {"calculator": Calculator, "python": _python_tool}
"""Built-in tools by name."""


# ---- running one turn's calls ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `error` set when the call itself was malformed (the tool is not run)."""

    name: str
    args: dict
    error: str = ""


def _error(text: str) -> str:
    return f"error: {text}"


async def _run_one(call: ToolCall, tools: dict[str, Tool], timeout_s: float) -> tuple[str, bool]:
    if call.error:
        return _error(call.error), False
    tool = tools.get(call.name)
    if tool is None:
        return _error(f"unknown tool {call.name!r}; available: {sorted(tools)}"), False
    try:
        result = await asyncio.wait_for(tool.call(call.args), timeout_s)
    except asyncio.TimeoutError:
        return _error(f"{call.name} took longer than {timeout_s:g} s"), False
    except Exception as exc:  # any failure of a tool is the model's observation, never a crashed step
        return _error(f"{type(exc).__name__}: {exc}"), False
    return str(result), True


def call_tools(
    calls: list[list[ToolCall]], tools: list[dict[str, Tool]], timeout_s: float
) -> list[list[tuple[str, bool]]]:
    """Run every row's calls concurrently; per row, per call: (result text, ok). `tools[i]`: row i's tools."""

    async def run_all():
        jobs = [_run_one(c, tools[i], timeout_s) for i, row in enumerate(calls) for c in row]
        return await asyncio.gather(*jobs)

    flat = iter(asyncio.run(run_all()) if any(calls) else [])
    return [[next(flat) for _ in row] for row in calls]
