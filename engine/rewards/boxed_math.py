"""Boxed math (MATH, MATH-500 and similar): the last `\\boxed{...}` of the response vs the ground truth.

The answer is read as verl's `math_reward.last_boxed_only_string` reads it: the content of the last
`\\boxed{...}` (nested braces allowed), or after `\\boxed ` (a space) everything up to the next `$` or the
end (`$\\boxed 5$, as required` -> `5`). `\\fbox{...}` is read only when there is no `\\boxed` at all (verl
reads it then too, but scores it 0). Where a `\\boxed ` comes before a later `\\boxed{...}`, the later box
is read (verl reads from the `\\boxed ` on).

A normalised string compare with every normalisation of verl's `math_reward.strip_string` (MATH's own),
so scores match verl's on its data, plus a few of our own:
- verl's: line breaks and spaces removed; `\\!` removed; `\\\\` -> `\\`; `\\dfrac`/`\\tfrac` -> `\\frac`; `\\left`
  and `\\right` removed; degrees (`^\\circ`, `^{\\circ}`), `\\$` and `\\%` removed; units written as a trailing
  `\\text{ ...}` removed; a leading `.5` -> `0.5` (also after a space or `{`); a short left-hand side `x = `
  removed; `\\sqrt3` -> `\\sqrt{3}`; `\\frac12` / `\\frac1b` -> `\\frac{1}{2}` / `\\frac{1}{b}`; an integer ratio
  `a/b` -> `\\frac{a}{b}`; `0.5` -> `\\frac{1}{2}`.
- ours: `\\,` `\\;` `\\:` spacing, a bare `$` or `%`, and a trailing `.` removed; `\\left`/`\\right` only as
  whole commands (`\\leftarrow` stays).
No other symbolic equivalence ("2/4" != "\\frac{1}{2}"). Score 1.0 if equal, else 0.0. The data_source "math"
is not this rule's: verl scores it as DAPO math (`engine.rewards.dapo_math`).
"""

from __future__ import annotations

import re

from engine.rewards.registry import register_rule

_SIZING = re.compile(r"\\(?:left|right)(?![a-zA-Z])")
_SPACING = re.compile(r"\\[!,;:]")
# MATH writes money as `\$`, percent as `\%`: the backslash goes with the mark
_MARKS = re.compile(r"\\?[$%]|\^(?:\\circ|\{\\circ\})")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\boxed x` (to the next `$`), else of the last `\\fbox{...}`;
    None if absent or unbalanced."""
    command = "\\boxed" if "\\boxed" in text else "\\fbox"
    start = text.rfind(command)
    if start < 0:
        return None
    i = start + len(command)
    if text[i : i + 1] == " " and command == "\\boxed":  # `$\boxed 5$, as required`
        return text[i + 1 :].split("$")[0]
    if text[i : i + 1] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


_UNITS = "\\text{ "  # MATH writes units as a trailing `\text{ cm}`
_SHORT_LHS = re.compile(r"^[^=]{0,2}=(?=[^=]*$)")  # `x = 5`, `k=5`: one `=` after at most two characters
_SQRT_BARE = re.compile(r"\\sqrt(?!\{)(.)")
_FRAC_BARE = re.compile(r"\\frac(?!\{)(.)(\{|.)?")
_INT_RATIO = re.compile(r"^(-?\d+)/(-?\d+)$")


def _fix_frac(match: re.Match) -> str:
    first, second = match.group(1), match.group(2)
    if second is None:  # `\frac1` at the end: nothing to fix
        return match.group(0)
    return f"\\frac{{{first}}}" + (second if second == "{" else f"{{{second}}}")


def _int_ratio(answer: str) -> str:
    match = _INT_RATIO.match(answer)
    if match is None or answer != f"{int(match.group(1))}/{int(match.group(2))}":
        return answer
    return f"\\frac{{{int(match.group(1))}}}{{{int(match.group(2))}}}"


def normalize_math_answer(answer: str) -> str:
    answer = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    answer = answer.replace("tfrac", "frac").replace("dfrac", "frac")
    answer = _SPACING.sub("", _SIZING.sub("", answer))
    answer = _MARKS.sub("", answer)
    if _UNITS in answer:
        answer = answer.split(_UNITS)[0]
    answer = answer.replace(" .", " 0.").replace("{.", "{0.")
    if answer.startswith("."):
        answer = "0" + answer
    answer = _SHORT_LHS.sub("", answer)
    answer = _SQRT_BARE.sub(r"\\sqrt{\1}", answer)
    answer = re.sub(r"\s+", "", answer).rstrip(".")
    answer = _FRAC_BARE.sub(_fix_frac, answer)
    if answer == "0.5":
        answer = "\\frac{1}{2}"
    return _int_ratio(answer)


def boxed_answer(solution_str: str) -> str | None:
    """The normalised content of the last box (what `boxed_math_score` compares), None without one."""
    answer = last_boxed(solution_str)
    return None if answer is None else normalize_math_answer(answer)


@register_rule(
    "boxed_math",
    sources=(
        "boxed",
        "lighteval/math",
        "digitallearninggmbh/math-lighteval",
        "huggingfaceh4/math-500",
    ),
    oracle=lambda truth: f"\\boxed{{{truth}}}",
    answer=boxed_answer,
)
def boxed_math_score(solution_str: str, ground_truth: str) -> float:
    truth = last_boxed(ground_truth) if "\\boxed" in ground_truth else ground_truth
    answer = last_boxed(solution_str)
    return float(answer is not None and normalize_math_answer(answer) == normalize_math_answer(truth or ""))
