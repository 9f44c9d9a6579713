"""DAPO-Math (DAPO-Math-17k, whose prompts ask for 'Answer: $Answer'): the last `Answer:` line vs the truth.

Scored as verl's `math_dapo.compute_score`, which verl uses for the data_source names "math_dapo", "math" and
"math_dapo_reasoning" (here "math_dapo" also as a prefix and in any case; "math" only exactly, so "MATH" and
"math/..." sets, which may hold boxed answers, are refused). verl also sends names starting with "aime" here;
we refuse them, so an AIME set written for boxed answers is not silently scored -1: name it
"math_dapo/aime..." or set `reward.fn`.

- only the last 300 characters of the response are read; in them, the last `Answer:` (any case, spaces
  around the colon, or a line break after it) and the rest of its line are the answer;
- answer and ground truth are normalised alike, as Minerva (Lewkowycz et al., 2022) does: the part after
  the last `=`; spaces, `\\$`, "a "/"an " removed and `\\text{and}` -> `,`; units and filler words removed
  ("cm", "dollars", "degrees", `^\\circ`, `\\text{}`, `\\ldots`, ...); on each line with two `$`, only the
  first `$...$` kept; `\\text{x}`, `\\textbf{x}`, `\\overline{x}`, `\\boxed{x}` unwrapped; `\\frac12` ->
  `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`; `$` removed; commas removed from a whole number ("1,000" ->
  "1000").
No other equivalence: "0.5" != "\\frac{1}{2}", and a trailing period stays ("34." != "34").

Score +1.0 if equal, else -1.0 (a missing answer too), as verl: unlike the other rules (0 or 1), a wrong
answer is -1, so the mean reward is 2 * accuracy - 1. One departure: a response without an `Answer:` line
never matches (verl compares the placeholder "[INVALID]", so it would match a ground truth "[INVALID]").

The rule returns verl's dict, `{"score": +-1.0, "acc": 1.0 or 0.0, "pred": the normalised answer}` (verl's
`acc` is a bool; `pred` is None without an `Answer:` line, where verl's is "[INVALID]"). `acc` is a numeric
extra (engine/rewards/reward_fn.py), logged as verl users read it:
- training: `reward/extra/acc`, the mean over the step's responses (verl's trainer only dumps it with the
  generations);
- validation: `val/<data_source>/extra/acc` for the one response per prompt (verl's
  `val-core/<data_source>/acc/mean@1`), and with rollout.val_n=k > 1 `val/<data_source>/extra/acc/mean@k`
  (verl's `val-core/<data_source>/acc/mean@k`); unlike `val/<data_source>/reward` they read 0..1.
`pred` is a string, so it is not logged; validation's `maj@k` reads the same answer through the rule's
`answer` (`dapo_answer`), as verl's `maj@N` reads `pred`.
"""

from __future__ import annotations

import re

from engine.rewards.registry import register_rule

_CLIP_CHARS = 300  # verl reads only the end of a response
# `\s*` after the colon may cross a line break ("Answer:\n42" answers 42), the answer itself may not
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Minerva's normalisation tables, applied in this order (the order matters: "\text{m}" becomes "\text{}",
# which a later removal drops; "\text{}^2" goes before "\text{}").
_REPLACED = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    *("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue"),
    *("points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals"),
    *("edges", "students", "childrentickets", "multiples"),
    *("\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}"),
    *("\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots"),
)
# `.` stops at a line break, so each line is handled on its own
_FIRST_INLINE_MATH = re.compile(r".*?\$(.*?)\$.*")
_UNWRAPPED = tuple(re.compile(rf"\\{command}\{{(.*?)\}}") for command in ("text", "textbf", "overline"))
_BOXED = re.compile(r"\\boxed\{(.*)\}")  # greedy: to the line's last `}`
# `[^{]` also takes a line break (unlike `.`)
_FRAC_BARE = re.compile(r"frac([^{])(.)")
_SQRT_BARE = re.compile(r"sqrt([^{])")


def normalize_dapo_answer(answer: str) -> str:
    """Minerva's normal form of a final answer (module docstring)."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACED:
        answer = answer.replace(old, new)
    for text in _REMOVED:
        answer = answer.replace(text, "")
    answer = _FIRST_INLINE_MATH.sub(r"$\1$", answer)
    for wrapper in _UNWRAPPED:
        answer = wrapper.sub(r"\1", answer)
    answer = _BOXED.sub(r"\1", answer)
    answer = _FRAC_BARE.sub(r"frac{\1}{\2}", answer)
    answer = _SQRT_BARE.sub(r"sqrt{\1}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_answer(solution_str: str) -> str | None:
    """The normalised answer of the last `Answer:` line in the response's tail; None without one."""
    found = _ANSWER_LINE.findall(solution_str[-_CLIP_CHARS:])
    return normalize_dapo_answer(found[-1]) if found else None


@register_rule(
    "math_dapo",
    sources=("math_dapo", "math_dapo_reasoning"),
    exact_sources=("math",),
    oracle=lambda truth: f"Answer: {truth}",
    answer=dapo_answer,
)
def dapo_math_score(solution_str: str, ground_truth: str) -> dict[str, float | str | None]:
    """{"score": 1.0 or -1.0, "acc": 1.0 or 0.0, "pred": the answer read, None without one} (module docstring)."""
    answer = dapo_answer(solution_str)
    correct = answer is not None and answer == normalize_dapo_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": answer}
