"""GSM8K: the answer after `####` (or the last number) in the response against the ground truth.

`method` picks how the answer is read, as `reward.gsm8k_method` sets it:
- `strict` (default): verl's `gsm8k.compute_score(method="strict")`, so curves compare with verl runs: in the
  last 300 characters, the last `#### <digits, dots, commas>` (one space after `####`, an optional `-`),
  commas removed, compared with the ground truth as a string ("#### 72.0" != "72", "#### $72" has no answer).
- `flexible`: verl's `method="flexible"`: the last number-like run in the last 300 characters, commas kept,
  compared as a string.
- `numeric`: lenient: the number directly after the last `####` anywhere in the response (spaces and `$`
  allowed, commas removed), compared as a decimal number ("#### $1,000.0" = 1000).
Score 1.0 if equal, else 0.0 (no format score). A ground truth holding `####` (GSM8K's raw answer) is reduced
to the number after it first, as verl's data preparation does.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from engine.rewards.registry import register_rule

METHODS = ("strict", "flexible", "numeric")
_CLIP_CHARS = 300  # verl reads only the end of a response
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last `####` (`numeric` reading), without commas or `$`; None if there is none."""
    pos = text.rfind("####")
    if pos < 0:
        return None
    match = _NUMBER.match(text[pos + 4 :].replace("$", "").lstrip())
    return match.group(0).replace(",", "") if match else None


def extract_verl_answer(text: str, method: str) -> str | None:
    """The answer as verl's `gsm8k.extract_solution(text, method)` reads it; None if there is none."""
    tail = text[-_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_FLEXIBLE.findall(tail)):
        if candidate not in ("", "."):
            return candidate
    return None


def _to_decimal(number: str) -> Decimal | None:
    try:
        return Decimal(number)
    except InvalidOperation:
        return None


def _truth_text(ground_truth: str) -> str:
    if "####" not in ground_truth:
        return ground_truth.strip()
    found = _STRICT.findall(ground_truth)
    return found[-1].replace(",", "") if found else (extract_gsm8k_answer(ground_truth) or "")


def gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer `gsm8k_score` compares (for `numeric`, the number in a canonical form: "1,000.0" -> "1000")."""
    if method != "numeric":
        return extract_verl_answer(solution_str, method)
    number = extract_gsm8k_answer(solution_str)
    value = _to_decimal(number) if number is not None else None
    return None if value is None else format(value.normalize(), "f")


@register_rule(
    "gsm8k", sources=("openai/gsm8k", "gsm8k"), oracle=lambda truth: f"#### {truth}", answer=gsm8k_answer
)
def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict") -> float:
    if method not in METHODS:
        raise ValueError(f"gsm8k method {method!r}: expected one of {METHODS}")
    truth_text = _truth_text(ground_truth)
    if method != "numeric":
        return float(extract_verl_answer(solution_str, method) == truth_text)
    truth = _to_decimal(truth_text.replace(",", "").replace("$", ""))
    if truth is None:
        raise ValueError(f"gsm8k ground truth {ground_truth!r} is not a number")
    answer = extract_gsm8k_answer(solution_str)
    return float(answer is not None and _to_decimal(answer) == truth)
