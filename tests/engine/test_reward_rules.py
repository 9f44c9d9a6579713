"""engine.rewards rules by data_source: DAPO math (`Answer:` lines, +1/-1, verl's dict with `acc` and `pred`),
its routing, and how the boxed rule reads `\\boxed 5$` and `\\fbox`. Expected values are worked out by hand
from the rules' docstrings (verl's `math_dapo.compute_score` and `math_reward.compute_score` agree on every one
except where marked)."""

import math

import pytest
import torch

from engine.rewards.boxed_math import boxed_math_score, last_boxed
from engine.rewards.build import build_reward_fn
from engine.rewards.registry import find_rule, rule_answer, rule_reward


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("Let me compute.\nAnswer: 34", "34", 1.0),
        ("Answer: 35", "34", -1.0),  # wrong is -1, not 0
        ("so the answer is 34", "34", -1.0),  # no `Answer:` line
        (r"so \boxed{34}", "34", -1.0),  # a box alone is no answer here
        ("Answer:", "34", -1.0),
        ("Answer: 7\nOn second thought...\nAnswer: 34", "34", 1.0),  # the last line counts
        ("Answer: 34\nAnswer: 7", "34", -1.0),
        ("Answer: 34\n" + "x" * 300, "34", -1.0),  # outside the last 300 characters
        ("x" * 1000 + "\nAnswer: 34", "34", 1.0),
        ("answer :\n34", "34", 1.0),  # any case, a space before the colon, a line break after it
        ("**Final Answer:** 34", "34", -1.0),  # the answer is "** 34"
        ("Answer: 34.", "34", -1.0),  # a trailing period stays
        ("Answer: $34$", "34", 1.0),
        ("Answer: The result is $12$.", "12", 1.0),  # only the first `$...$` is kept
        ("Answer: 10,000", "10000", 1.0),  # commas go from whole numbers
        ("Answer: (1, 2)", "(1,2)", 1.0),  # spaces go everywhere
        ("Answer: 5 \\text{ cm}", "5", 1.0),  # "cm" then the empty `\text{}` removed
        ("Answer: 5 dollars", "\\$5", 1.0),
        ("Answer: 30^\\circ", "30", 1.0),
        ("Answer: \\text{(A)}", "(A)", 1.0),
        ("Answer: \\boxed{1,000}", "1000", 1.0),  # the box unwrapped, then the commas removed
        ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
        ("Answer: \\sqrt3", "\\sqrt{3}", 1.0),
        ("Answer: x = 5", "5", 1.0),  # the part after the last `=`, of the truth too
        ("Answer: 12", "x = 12", 1.0),
        ("Answer: 0.5", "\\frac{1}{2}", -1.0),  # no numeric equivalence
    ],
)
def test_math_dapo_scores(response, truth, score):
    out = rule_reward("math_dapo", response, truth)
    assert (out["score"], out["acc"]) == (score, float(score == 1.0))
    assert out["pred"] == rule_answer("math_dapo", response)


def test_math_dapo_returns_verls_dict():
    """verl's compute_score returns {"score": reward, "acc": correct, "pred": pred}: by hand, as verl would
    (its acc a bool, here 1.0 / 0.0; its pred without an `Answer:` line "[INVALID]", here None)."""
    cases = [
        ("math_dapo", "So.\nAnswer: 1,000", "1000", {"score": 1.0, "acc": 1.0, "pred": "1000"}),
        ("math", "Answer: $\\frac 12$", "2", {"score": -1.0, "acc": 0.0, "pred": "\\frac{1}{2}"}),
        ("math_dapo", "no answer", "3", {"score": -1.0, "acc": 0.0, "pred": None}),
    ]
    for source, response, truth, verl in cases:
        assert rule_reward(source, response, truth) == verl, response
    # through the trainer's reward function: acc is an extra; pred (a string) is not; a row of a float rule
    # (boxed math) has no acc (NaN, left out of the logged means)
    result = build_reward_fn("").score(
        ["math_dapo", "lighteval/MATH", "math_dapo", "math_dapo"],
        ["Answer: 3", r"\boxed{3}", "Answer: 4", "3"],
        ["3"] * 4,
    )
    assert result.scores.tolist() == [1.0, 1.0, -1.0, -1.0] and sorted(result.extras) == ["acc"]
    torch.testing.assert_close(result.extras["acc"], torch.tensor([1.0, math.nan, 0.0, 0.0]), equal_nan=True)


def test_math_dapo_answer_and_oracle():
    assert rule_answer("math_dapo", "...\nAnswer: 1,000") == "1000"
    assert rule_answer("math_dapo", "Answer: $\\frac 12$ dollars") == "\\frac{1}{2}"
    assert rule_answer("math_dapo", r"\boxed{3}") is None
    rule = find_rule("math_dapo")
    for truth in ["34", "\\frac{1}{2}", "x = 5", "1,000", "5 \\text{ cm}"]:
        assert rule.score(rule.oracle(truth), truth)["score"] == 1.0, truth
    assert rule.oracle("34") == "Answer: 34"


def test_math_dapo_routing():
    for name in ["math_dapo", "math", "math_dapo_reasoning", "MATH_DAPO", "math_dapo/train"]:
        assert find_rule(name).name == "math_dapo", name
    for name in ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "boxed"]:
        assert find_rule(name).name == "boxed_math", name
    # "math" is an exact name only (case included, as verl), and names starting with "aime" (verl: math_dapo)
    # are refused
    for name in ["MATH", "math/level5", "math_train", "aime", "aime24", "aime_2024", "math-ai/aime24"]:
        assert find_rule(name) is None, name
    with pytest.raises(ValueError, match=r"data_source='aime24'; known .*'math \(exact\)'.*'math_dapo'"):
        rule_reward("aime24", "Answer: 5", "5")
    fn = build_reward_fn("")
    scores = fn(
        ["math_dapo", "math", "lighteval/MATH", "math_dapo"],
        ["Answer: 3", "Answer: 3", r"\boxed{3}", "3"],
        ["3"] * 4,
    )
    assert scores.tolist() == [1.0, 1.0, 1.0, -1.0]


@pytest.mark.parametrize(
    "response, box",
    [
        ("The answer is $\\boxed 5$, as required.", "5"),  # `\boxed ` reads to the next `$`
        ("$\\boxed \\frac 12$", "\\frac 12"),
        ("$\\boxed x = 5$", "x = 5"),
        ("so \\boxed (1, 2)", "(1, 2)"),  # or to the end
    ],
)
def test_last_boxed_space(response, box):
    assert last_boxed(response) == box


def test_last_boxed_fbox_only_without_boxed():
    assert last_boxed("\\boxed{1/2}, checked with \\fbox{7}") == "1/2"  # any `\boxed` wins over `\fbox`
    assert last_boxed("\\fbox{7} then \\boxed{1/2}") == "1/2"
    assert last_boxed("\\fbox{5}") == "5"  # verl reads it, then scores it 0
    assert last_boxed("\\boxed 7 and then \\boxed{5}") == "5"  # the last box (verl: "7 and then \boxed{5}")


def test_boxed_space_and_fbox_scores():
    assert boxed_math_score("The answer is $\\boxed 5$, as required.", "5") == 1.0
    assert boxed_math_score("$\\boxed \\frac 12$", "\\frac{1}{2}") == 1.0
    assert boxed_math_score("$\\boxed x = 5$", "5") == 1.0
    assert boxed_math_score("$\\boxed 5 - 2\\sqrt{3}$", "5") == 0.0  # not the first word alone
    assert boxed_math_score("\\boxed{1/2}, checked with \\fbox{7}", "\\frac{1}{2}") == 1.0
