"""Boxed math (MATH, MATH-500 and similar): the last `\\boxed{...}` of the response vs the ground truth.

Deliberately simple: a normalised string compare (spaces, `\\left`/`\\right`, `\\!`-style spacing and a
trailing `.` removed; dollar, percent and degree marks removed with their backslash: `\\$18.90`, `$18.90`
and `18.90` are equal, as are `50\\%`, `50%` and `50`, and `30^\\circ`, `30^{\\circ}` and `30`;
`\\dfrac`/`\\tfrac` -> `\\frac`), no symbolic equivalence ("0.5" != "\\frac12", ".5" != "0.5") and no unit
stripping (`5\\text{ cm}` != "5"). Score 1.0 if equal, else 0.0.
"""

from __future__ import annotations

import re

from engine.rewards.registry import register_rule

_SIZING = re.compile(r"\\(?:left|right)(?![a-zA-Z])")
_SPACING = re.compile(r"\\[!,;:]")
# MATH writes money as `\$`, percent as `\%`: the backslash goes with the mark
_MARKS = re.compile(r"\\?[$%]|\^(?:\\circ|\{\\circ\})")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed) or `\\boxed x`; None if absent/unbalanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text[i : i + 1] == " ":  # `\boxed 5`: the answer is the next word
        word = text[i:].split()
        return word[0].rstrip("$") if word else None
    if text[i : i + 1] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def normalize_math_answer(answer: str) -> str:
    answer = _SPACING.sub("", _SIZING.sub("", answer))
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return _MARKS.sub("", re.sub(r"\s+", "", answer)).rstrip(".")


@register_rule(
    "boxed_math",
    sources=(
        "math",
        "boxed",
        "lighteval/math",
        "digitallearninggmbh/math-lighteval",
        "huggingfaceh4/math-500",
    ),
    oracle=lambda truth: f"\\boxed{{{truth}}}",
)
def boxed_math_score(solution_str: str, ground_truth: str) -> float:
    truth = last_boxed(ground_truth) if "\\boxed" in ground_truth else ground_truth
    answer = last_boxed(solution_str)
    return float(answer is not None and normalize_math_answer(answer) == normalize_math_answer(truth or ""))
