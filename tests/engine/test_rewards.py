"""engine.rewards: rules, dispatch, user functions, output checks (the reward_check CLI: test_reward_check.py)."""

import os
import re
import sys
import time

import pytest
import torch

from engine.errors import RewardFnCallError
from engine.rewards.boxed_math import boxed_math_score, last_boxed
from engine.rewards.build import build_reward_fn
from engine.rewards.embedded import positional_score
from engine.rewards.gsm8k import extract_gsm8k_answer, gsm8k_score
from engine.rewards.registry import find_rule, rule_reward

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("48 + 24 = 72\n#### 72", "72", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### $1,234.50.", "1234.5", 1.0),
        ("so it is #### -5", "-5", 1.0),
        ("#### $-5", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        ("#### 3 first, then #### 4", "4", 1.0),  # the last #### counts
        ("#### 4 and later #### 3", "4", 0.0),
        ("the answer is 72", "72", 0.0),  # missing ####
        ("#### the answer is 72", "72", 0.0),  # the number must follow ####
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # raw GSM8K answer as ground truth
        ("#### 72", "1,072", 0.0),
    ],
)
def test_gsm8k_numeric(response, truth, score):
    assert gsm8k_score(response, truth, method="numeric") == score


def test_gsm8k_extract_and_bad_ground_truth():
    assert extract_gsm8k_answer("x #### -1,024.5 apples") == "-1024.5"
    assert extract_gsm8k_answer("no marker") is None
    with pytest.raises(ValueError, match="gsm8k ground truth 'seven' is not a number"):
        gsm8k_score("#### 7", "seven", method="numeric")
    assert gsm8k_score("#### 7", "seven") == 0.0  # strict compares strings, as verl does


def _verl_gsm8k(solution_str, ground_truth, method="strict"):
    """verl's gsm8k.compute_score (verl/utils/reward_score/gsm8k.py), restated for an independent check."""
    solution_str = solution_str[-300:]
    if method == "strict":
        found = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        answer = found[-1].replace(",", "").replace("$", "") if found else None
    else:
        answer = None
        for answer in reversed(re.findall("(\\-?[0-9\\.\\,]+)", solution_str)):
            if answer not in ["", "."]:
                break
    return 0.0 if answer is None else float(answer == ground_truth)


_GSM8K_RESPONSES = [
    "48 + 24 = 72\n#### 72",
    "#### 1,000",
    "#### $1,234.50.",
    "#### 1,234.5",
    "so it is #### -5",
    "#### 72.0",
    "#### 72 apples",
    "####72",
    "the answer is 72",
    "the answer is 72.",
    "#### 3 first, then #### 4",
    "x" * 400 + " #### 72",
    "#### 72 " + "y" * 400,
    "#### 72 and then 1,000 more.",
    "",
    ". .",
]


@pytest.mark.parametrize("method", ["strict", "flexible"])
@pytest.mark.parametrize("truth", ["72", "1000", "1234.5", "-5", "4"])
def test_gsm8k_matches_verl(method, truth):
    for response in _GSM8K_RESPONSES:
        expected = _verl_gsm8k(response, truth, method)
        assert gsm8k_score(response, truth, method=method) == expected, (response, truth, method)


def test_gsm8k_default_is_verl_strict():
    assert gsm8k_score("#### 72", "72") == 1.0
    assert gsm8k_score("#### 72.0", "72") == 0.0  # numeric would say 1.0
    assert gsm8k_score("#### $72", "72") == 0.0
    assert gsm8k_score("the answer is 72", "72", method="flexible") == 1.0
    assert gsm8k_score("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72") == 1.0  # raw answer as truth
    fn = build_reward_fn("")
    assert fn(["openai/gsm8k"], ["#### 72.0"], ["72"]).tolist() == [0.0]
    fn = build_reward_fn("", gsm8k_method="numeric")
    assert fn(["openai/gsm8k"], ["#### 72.0"], ["72"]).tolist() == [1.0]
    with pytest.raises(ValueError, match="gsm8k method 'loose'"):
        gsm8k_score("#### 72", "72", method="loose")


@pytest.mark.parametrize(
    "response, truth, score",
    [
        (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\dfrac{1}{2}}.", r"\frac{1}{2}", 1.0),
        (r"\boxed{x^{2} + \left( y \right)}", r"x^{2}+(y)", 1.0),
        (r"\boxed{1} then \boxed{\{1,\!2\}}", r"\{1,2\}", 1.0),  # the last box, nested braces
        (r"\boxed{3.}", "3", 1.0),
        (r"\boxed 7", "7", 1.0),
        (r"\boxed{2}", "3", 0.0),
        ("the answer is 3", "3", 0.0),  # no box
        (r"\boxed{\frac{1}{2}", r"\frac{1}{2}", 0.0),  # unbalanced
        (r"$\boxed{5}$", r"\boxed{5}", 1.0),  # ground truth given boxed
        # money, percent and degree marks go with their backslash (MATH writes `\$18.90`), both ways
        (r"\boxed{18.90}", r"\$18.90", 1.0),
        (r"\boxed{\$18.90}", "18.90", 1.0),
        (r"\boxed{\$18.90}", r"\$18.90", 1.0),
        (r"\boxed{$18.90}", r"\$18.90", 1.0),
        (r"\boxed{\$18.90}", "18.91", 0.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{50}", r"50\%", 1.0),
        (r"\boxed{30^\circ}", "30", 1.0),
        (r"\boxed{30}", r"30^{\circ}", 1.0),
    ],
)
def test_boxed_math(response, truth, score):
    assert boxed_math_score(response, truth) == score


# Expected scores are what verl's `math_reward.compute_score` (verl commit b178a3c) returned on these pairs.
VERL_MATH_SCORES = [
    ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{2/4}", "\\frac{1}{2}", 0.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{k=5}", "5", 1.0),
    ("\\boxed{xyz = 5}", "5", 0.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{30^\\circ}", "30", 1.0),
    ("\\boxed{30^{\\circ}}", "30", 1.0),
    ("\\boxed{\\$18.90}", "18.90", 1.0),
    ("\\boxed{18.90}", "\\$18.90", 1.0),
    ("\\boxed{\\sqrt3}", "\\sqrt{3}", 1.0),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt3", 1.0),
    ("\\boxed{\\frac1{72}}", "\\frac{1}{72}", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{\\tfrac{3}{4}}", "\\frac34", 1.0),
    ("\\boxed{ 3 }", "3", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{\\{1,\\!2\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{10}", "10.0", 0.0),
    ("no box 5", "5", 0.0),
    ("\\boxed 7$", "7", 1.0),
    ("\\boxed{\\infty}", "\\infty", 1.0),
    ("\\boxed{\\pi}", "\\pi", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\dfrac{\\sqrt3}{2}", 1.0),
]


@pytest.mark.parametrize("response, truth, verl_score", VERL_MATH_SCORES)
def test_boxed_math_scores_like_verl(response, truth, verl_score):
    assert boxed_math_score(response, truth) == verl_score


def test_rule_answers_for_majority_votes():
    from engine.rewards.registry import rule_answer

    assert rule_answer("lighteval/MATH", r"so \boxed{\dfrac12}.") == r"\frac{1}{2}"
    assert rule_answer("openai/gsm8k", "#### 1,000") == "1000"
    assert rule_answer("openai/gsm8k", "#### 1,000.0", {"gsm8k": {"method": "numeric"}}) == "1000"
    assert rule_answer("openai/gsm8k", "no answer") is None
    assert rule_answer("embedded/copy", " 1234 ") == "1234"
    assert rule_answer("unknown/source", "x") is None


def test_last_boxed_nested():
    assert last_boxed(r"a \boxed{\frac{a}{b^{2}}} b") == r"\frac{a}{b^{2}}"


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("123456", "123456", 1.0),
        ("123000", "123456", 0.5),
        (" 123456\n", "123456", 1.0),  # surrounding whitespace ignored
        ("1234", "123456", 4 / 6),  # missing characters are wrong
        ("12345678", "123456", 6 / 8),  # extra characters are wrong
        ("", "123456", 0.0),
        ("777777", "777777", 1.0),
    ],
)
def test_embedded_partial_credit(response, truth, score):
    assert positional_score(response, truth) == pytest.approx(score)


def test_dispatch_by_data_source():
    assert find_rule("openai/gsm8k").name == "gsm8k"
    assert find_rule("GSM8K_train").name == "gsm8k"  # case-insensitive prefix
    assert find_rule("HuggingFaceH4/MATH-500").name == "boxed_math"
    assert find_rule("lighteval/MATH/level5").name == "boxed_math"
    assert find_rule("mathematics") is None  # a prefix must end at a separator
    assert find_rule("embedded/copy").name == find_rule("embedded/target").name == "embedded"
    assert rule_reward("embedded/target", "555", "555", {}) == 1.0
    with pytest.raises(ValueError, match=r"data_source='my/data'; known .*'openai/gsm8k'.*reward.fn="):
        rule_reward("my/data", "x", "y", {})


def test_builtin_reward_fn_batch():
    fn = build_reward_fn("")
    scores = fn(
        ["openai/gsm8k", "lighteval/MATH", "embedded/copy"],
        ["#### 3", r"\boxed{2}", "1200"],
        ["3", "2", "1234"],
    )
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 1.0, 0.5]
    with pytest.raises(ValueError, match="unknown/src"):
        fn.check_data_sources(["gsm8k", "unknown/src"])
    with pytest.raises(ValueError, match="differ in length"):
        fn(["gsm8k"], ["a", "b"], ["1"])


USER_MODULE = """
import math

def score(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str == ground_truth) + extra_info.get("bonus", 0)

def as_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "acc": 1, "pred": solution_str}

def nan(data_source, solution_str, ground_truth, extra_info):
    return math.nan if solution_str == "bad" else 1.0

def inf(data_source, solution_str, ground_truth, extra_info):
    return math.inf

def text(data_source, solution_str, ground_truth, extra_info):
    return "1.0"

def no_score(data_source, solution_str, ground_truth, extra_info):
    return {"reward": 1.0}

def boom(data_source, solution_str, ground_truth, extra_info):
    raise KeyError("answer")

def two_args(data_source, solution_str):
    return 1.0

def with_extra(data_source, solution_str, ground_truth, extra_info):
    return {"score": float(solution_str == ground_truth), "length": len(solution_str)}

def reordered(solution_str, ground_truth, data_source=None, extra_info=None):
    return float(solution_str == ground_truth)

def keywords_only(*, ground_truth, **kwargs):
    return float(kwargs["solution_str"] == ground_truth)

def other_names(source, response, truth, info):
    return 1.0

def quits(data_source, solution_str, ground_truth, extra_info):
    import sys
    sys.exit(0)

def numpy_outputs(data_source, solution_str, ground_truth, extra_info):
    import numpy as np
    return np.bool_(solution_str == ground_truth) if data_source == "b" else np.array(0.25)
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_MODULE)
    return str(path)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "pkg_reward_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "pkg_reward_mod"
    sys.modules.pop("pkg_reward_mod", None)


def test_extras_a_response_lacks_are_nan():
    """A key some outputs lack (a float output, a dict without it, a non-numeric value) is NaN for those
    responses (left out of the logged means); batches of responses join with the keys of all of them."""
    from engine.rewards.reward_fn import RewardFn, concat_extras

    def mixed(data_source, solution_str, ground_truth, extra_info):
        return {"d": {"score": 1.0, "acc": True}, "t": {"score": 0.0, "acc": "x"}}.get(data_source, 0.5)

    nan = float("nan")
    result = RewardFn(mixed, "mixed").score(["d", "f", "t"], ["r"] * 3, ["g"] * 3, [{}] * 3)
    assert result.scores.tolist() == [1.0, 0.5, 0.0] and sorted(result.extras) == ["acc"]
    torch.testing.assert_close(result.extras["acc"], torch.tensor([1.0, nan, nan]), equal_nan=True)
    joined = concat_extras(
        [{"acc": torch.tensor([1.0, 0.0])}, {}, {"acc": torch.tensor([0.5]), "b": torch.ones(1)}], [2, 1, 1]
    )
    torch.testing.assert_close(joined["acc"], torch.tensor([1.0, 0.0, nan, 0.5]), equal_nan=True)
    torch.testing.assert_close(joined["b"], torch.tensor([nan, nan, nan, 1.0]), equal_nan=True)


def test_user_fn_from_file_and_module(user_file, user_module):
    for spec in (f"{user_file}:score", f"{user_module}:score"):
        fn = build_reward_fn(spec)
        scores = fn(["anything", "x"], ["a", "b"], ["a", "c"], [{}, {"bonus": 0.25}])
        assert scores.tolist() == [1.0, 0.25], spec
        assert spec in fn.name
    result = build_reward_fn(f"{user_file}:as_dict").score(["s"], ["r"], ["g"], [{}])
    assert result.scores.tolist() == [0.5] and result.extras["acc"].tolist() == [1.0]
    assert "pred" not in result.extras  # non-numeric extras are not returned
    numpy_fn = build_reward_fn(f"{user_file}:numpy_outputs")  # numpy bools and 0-d arrays are numbers
    assert numpy_fn(["b", "b", "a"], ["1", "2", "x"], ["1", "1", "y"], [{}] * 3).tolist() == [1.0, 0.0, 0.25]
    for name in ("reordered", "keywords_only"):  # called by keyword, as verl calls them
        scores = build_reward_fn(f"{user_file}:{name}")(["s", "s"], ["42", "41"], ["42", "42"], [{}, {}])
        assert scores.tolist() == [1.0, 0.0], name


@pytest.mark.parametrize(
    "name, error, message",
    [
        ("nan", ValueError, r"returned nan for response 1"),
        ("inf", ValueError, r"returned inf for response 0"),
        ("text", RewardFnCallError, r"returned str '1.0' for response 0"),
        ("no_score", ValueError, r"returned a dict without 'score' \(keys \['reward'\]\) for response 0"),
        (
            "boom",
            RewardFnCallError,
            r"raised KeyError on response 0 \(data_source='s'\) at .*my_reward.py:\d+ in boom",
        ),
        ("quits", RewardFnCallError, r"raised SystemExit on response 0"),  # not a quiet exit of the rank
    ],
)
def test_user_fn_bad_outputs_name_the_function(user_file, name, error, message):
    fn = build_reward_fn(f"{user_file}:{name}")
    with pytest.raises(error, match=rf"reward.fn='.*my_reward.py:{name}' {message}"):
        fn(["s", "s"], ["ok", "bad"], ["g", "g"], [{}, {}])


def test_user_fn_loading_errors(tmp_path, user_file):
    cases = [
        ("no_colon", r"reward.fn='no_colon': expected 'module:function'"),
        ("surely_missing_module_x:fn", r"reward.fn='surely_missing_module_x:fn': cannot import module"),
        (f"{tmp_path}/absent.py:fn", r"reward.fn='.*absent.py:fn': file .* not found"),
        (
            f"{user_file}:absent",
            r"reward.fn='.*my_reward.py:absent': .* has no function 'absent'; its functions: \['as_dict'",
        ),
        (
            f"{user_file}:two_args",
            r"two_args must accept the keywords data_source, solution_str, ground_truth and extra_info",
        ),
        (f"{user_file}:other_names", r"other_names must accept the keywords data_source"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message):
            build_reward_fn(spec)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('oops')\n")
    with pytest.raises(ValueError, match=r"importing .*broken.py failed: RuntimeError: oops"):
        build_reward_fn(f"{broken}:fn")


WORKER_MODULE = """
import os
import time

def score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "boom":
        raise KeyError("answer")
    if solution_str == "text":
        return "1.0"
    return {"score": float(solution_str == ground_truth) + extra_info.get("bonus", 0), "acc": 1}
"""


def test_user_fn_in_a_process_stops_at_reward_timeout(tmp_path):
    """reward.timeout_s > 0: the function runs in a child process; a batch that never ends fails in time,
    naming the function and the response; errors and outputs are those of the in-process function."""
    from engine.rewards.worker import ProcessRewardFn

    path = tmp_path / "slow_reward.py"
    path.write_text(WORKER_MODULE)
    fn = build_reward_fn(f"{path}:score", timeout_s=2)
    assert isinstance(fn, ProcessRewardFn)
    result = fn.score(["s", "s"], ["a", "b"], ["a", "c"], [{}, {"bonus": 0.25}])
    assert result.scores.tolist() == [1.0, 0.25] and result.extras["acc"].tolist() == [1.0, 1.0]
    name = rf"reward.fn='{path}:score'"
    with pytest.raises(RewardFnCallError, match=rf"{name} raised KeyError on response 1"):
        fn(["s", "s"], ["a", "boom"], ["a", "a"], [{}, {}])
    with pytest.raises(RewardFnCallError, match=rf"{name} returned str '1.0' for response 0"):
        fn(["s"], ["text"], ["a"], [{}])
    child = fn._proc.pid
    start = time.monotonic()
    with pytest.raises(
        RewardFnCallError,
        match=rf"{name} did not finish a batch of 3 responses within reward.timeout_s=2 s: "
        r"it was on response 2 \(data_source='x'\) when stopped. Fix: .* raise reward.timeout_s",
    ):
        fn(["s", "s", "x"], ["a", "b", "hang"], ["a", "a", "a"], [{}, {}, {}])
    assert time.monotonic() - start < 2 + 5
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # killed and reaped
    with pytest.raises(
        RewardFnCallError, match=rf"{name}: the reward process exited \(code 3\) while scoring"
    ):
        fn(["s"], ["exit"], ["a"], [{}])  # a new child after the timeout
