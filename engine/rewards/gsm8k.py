"""GSM8K: the number after the last `####` in the response, compared numerically with the ground truth.

Like verl's strict GSM8K scorer: score 1.0 if equal, else 0.0 (no format score). Commas and `$` are
ignored ("#### $1,000" = 1000); the number must follow `####` directly (spaces allowed).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from engine.rewards.registry import register_rule

_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last `####`, without commas or `$`; None if there is none."""
    pos = text.rfind("####")
    if pos < 0:
        return None
    match = _NUMBER.match(text[pos + 4 :].replace("$", "").lstrip())
    return match.group(0).replace(",", "") if match else None


def _to_decimal(number: str) -> Decimal | None:
    try:
        return Decimal(number)
    except InvalidOperation:
        return None


@register_rule("gsm8k", sources=("openai/gsm8k", "gsm8k"), oracle=lambda truth: f"#### {truth}")
def gsm8k_score(solution_str: str, ground_truth: str) -> float:
    truth_text = extract_gsm8k_answer(ground_truth) if "####" in ground_truth else ground_truth
    truth = _to_decimal((truth_text or "").replace(",", "").replace("$", "").strip())
    if truth is None:
        raise ValueError(f"gsm8k ground truth {ground_truth!r} is not a number")
    answer = extract_gsm8k_answer(solution_str)
    return float(answer is not None and _to_decimal(answer) == truth)
