"""The reward function the trainer calls: the built-in rules, or the user's function named by `reward.fn`.

A user function has verl's signature, so users bring theirs unchanged:
    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float | dict
called as verl calls it, by keyword (`fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`):
the parameters may come in any order, have defaults, or be taken by `**kwargs`; a function that cannot take
these four keywords is refused when it is loaded
(a dict must hold "score"; its other numeric keys are returned as extras, which the trainer logs as
`reward/extra/<key>`, the mean over the step's responses on all DP replicas, and validation as
`val/<data_source>/extra/<key>` (engine/step/validation.py); a key whose value is not a number is ignored; a
response whose output lacks a key that others have, such as a float among dicts when the built-in rules of
several data sources score one batch, has NaN there, which the means leave out).
`reward.fn` is `module:function` (imported from sys.path) or `path/to/file.py:function`.
Every output is checked: one finite number per response; errors name the function and the response.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import RewardFnCallError, RewardFnError
from engine.rewards.registry import get_rule
from engine.user_code import import_target, is_file_target, split_target

UserRewardFn = Callable[..., "float | dict"]
ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""The keywords a reward function is called with (verl's names)."""
BUILTIN_NAME = "the built-in rule rewards (reward.fn empty)"
MISSING_EXTRA = float("nan")
"""An extra's value for a response whose output lacked that key; means over responses leave it out."""


@dataclass
class RewardResult:
    scores: torch.Tensor
    """(num_responses,) float32."""
    extras: dict[str, torch.Tensor]
    """Numeric keys (other than "score") that some dict output had, each (num_responses,) float32, NaN for the
    responses whose output lacked it (`MISSING_EXTRA`)."""


class RewardFn:
    """Scores decoded responses with `fn`, checking every output."""

    def __init__(self, fn: UserRewardFn, name: str, builtin: bool = False):
        self.fn, self.name, self.builtin = fn, name, builtin

    def check_data_sources(self, data_sources: Sequence[str]) -> None:
        """Fail fast (before training) if the built-in rules cannot score some data_source; no-op for user fns."""
        if self.builtin:
            for data_source in sorted(set(data_sources)):
                get_rule(data_source)

    def __call__(
        self,
        data_sources: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[str],
        extra_infos: Sequence[dict] | None = None,
    ) -> torch.Tensor:
        """One float32 score per response, shape (num_responses,)."""
        return self.score(data_sources, responses, ground_truths, extra_infos).scores

    def score(
        self,
        data_sources: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[str],
        extra_infos: Sequence[dict] | None = None,
    ) -> RewardResult:
        """Scores and the numeric extras of dict outputs."""
        if extra_infos is None:
            extra_infos = [{} for _ in responses]
        lengths = {len(data_sources), len(responses), len(ground_truths), len(extra_infos)}
        if len(lengths) != 1:
            raise ValueError(
                f"reward inputs differ in length: {len(data_sources)} data_sources, {len(responses)} responses, "
                f"{len(ground_truths)} ground_truths, {len(extra_infos)} extra_infos"
            )
        self.check_data_sources(data_sources)
        scores, extras = self._score_lists(data_sources, responses, ground_truths, extra_infos)
        return _as_result(scores, extras)

    def _score_lists(
        self,
        data_sources: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[str],
        extra_infos: Sequence[dict],
    ) -> tuple[list[float], list[dict[str, float]]]:
        """The checked score and numeric extras of each response, in this process."""
        scores, extras = [], []
        for i, args in enumerate(zip(data_sources, responses, ground_truths, extra_infos)):
            try:
                out = self.fn(**dict(zip(ARGUMENTS, args)))
            except (
                Exception,
                SystemExit,
            ) as exc:  # sys.exit() in the function must not end this rank quietly
                raise RewardFnCallError(
                    f"{self.name} raised {type(exc).__name__} on response {i} (data_source={args[0]!r}){_where(exc)}: "
                    f"{exc}. Fix: the function must return a number for every response"
                ) from exc
            score, extra = self._check_output(out, i, args[0])
            scores.append(score)
            extras.append(extra)
        return scores, extras

    def _check_output(self, out, i: int, data_source: str) -> tuple[float, dict[str, float]]:
        where = f"{self.name} returned {{}} for response {i} (data_source={data_source!r})"
        expected = "; expected a finite number or a dict with a finite 'score'"
        extra = {}
        if isinstance(out, Mapping):
            if "score" not in out:
                raise RewardFnCallError(
                    where.format(f"a dict without 'score' (keys {sorted(out)})") + expected
                )
            extra = {k: float(v) for k, v in out.items() if k != "score" and _as_number(v) is not None}
            out = out["score"]
        score = _as_number(out)
        if score is None:
            raise RewardFnCallError(where.format(f"{type(out).__name__} {str(out)[:40]!r}") + expected)
        if not math.isfinite(score):
            raise RewardFnCallError(where.format(f"{score}") + expected)
        return score, extra


def _where(exc: BaseException) -> str:
    """` at file:line in function` of the innermost frame of `exc` (the user's code: no traceback is shown)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    code = tb.tb_frame.f_code
    return f" at {code.co_filename}:{tb.tb_lineno} in {code.co_name}"


def _as_result(scores: list[float], extras: list[dict[str, float]]) -> RewardResult:
    keys = sorted(set().union(*extras))
    return RewardResult(
        scores=torch.tensor(scores, dtype=torch.float32),
        extras={
            key: torch.tensor([extra.get(key, MISSING_EXTRA) for extra in extras], dtype=torch.float32)
            for key in keys
        },
    )


def concat_extras(
    parts: Sequence[Mapping[str, torch.Tensor]], rows: Sequence[int]
) -> dict[str, torch.Tensor]:
    """The extras of consecutive batches of responses ({key: (rows[i],)} per batch) as one: every key any batch
    has, `MISSING_EXTRA` for the rows of a batch without it."""

    def column(part: Mapping[str, torch.Tensor], n: int, key: str) -> torch.Tensor:
        return part.get(key, torch.full((n,), MISSING_EXTRA, dtype=torch.float32))

    keys = sorted(set().union(*parts))
    return {
        key: torch.cat([column(part, n, key) for part, n in zip(parts, rows, strict=True)]) for key in keys
    }


def _as_number(value) -> float | None:
    """A real number (bool, int, float, numpy scalar or bool, one-element tensor or array) as float, else None."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if isinstance(value, (np.bool_, np.ndarray)):
        return float(value.item()) if value.size == 1 and value.dtype.kind in "biuf" else None
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def load_user_fn(spec: str) -> UserRewardFn:
    """Import the function named by `reward.fn` (`module:function` or `path/to/file.py:function`)."""
    parts = split_target(spec)
    if parts is None:
        raise RewardFnError(
            f"reward.fn={spec!r}: expected 'module:function' or 'path/to/file.py:function'. Fix: name the "
            "function after a colon, e.g. reward.fn=my_reward.py:score"
        )
    target, fn_name = parts
    try:
        module = import_target(target, "engine_user_reward_")
    except FileNotFoundError as exc:
        raise RewardFnError(
            f"reward.fn={spec!r}: file {exc} not found. Fix: give the path of an existing .py file "
            "(relative paths start at the working directory)"
        ) from exc
    except Exception as exc:
        if is_file_target(target):
            raise RewardFnError(
                f"reward.fn={spec!r}: importing {os.path.abspath(target)} failed: {type(exc).__name__}: {exc}. "
                "Fix: make the file import cleanly (python path/to/file.py shows the traceback)"
            ) from exc
        raise RewardFnError(
            f"reward.fn={spec!r}: cannot import module {target!r} ({type(exc).__name__}: {exc}). "
            "Fix: put it on PYTHONPATH, or give a file: reward.fn=path/to/file.py:function"
        ) from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise RewardFnError(
            f"reward.fn={spec!r}: {target} has no function {fn_name!r}; its functions: {names}. Fix: name one "
            "of them after the colon"
        )
    try:
        inspect.signature(fn).bind(**dict.fromkeys(ARGUMENTS, ""))
    except TypeError as exc:
        raise RewardFnError(
            f"reward.fn={spec!r}: {fn_name} must accept the keywords data_source, solution_str, ground_truth "
            f"and extra_info (it is called with them, as verl calls it): {exc}. Fix: name its parameters so"
        ) from exc
    except ValueError:  # builtins without a signature: let the first call tell
        pass
    return fn


def user_fn_name(fn_spec: str) -> str:
    """How messages name the user's function: `reward.fn='<spec>'`."""
    return f"reward.fn={fn_spec.strip()!r}"
