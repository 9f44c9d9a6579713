"""Rule rewards registered by `data_source`: one entry per family, matched by exact name or prefix.

A rule maps (solution_str, ground_truth) to a score, a float or, as verl's rules may, a dict holding "score"
and extras (`math_dapo`: verl's {"score", "acc", "pred"}; engine/rewards/reward_fn.py logs the numeric ones);
`oracle` formats a ground truth as the response the rule expects (used by `engine.reward_check` to show that
a perfect answer scores 1.0). A rule's scale is its own (most score 0..1; `math_dapo` scores -1 or +1, as
verl does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.errors import RewardFnError

# A data_source matches a registered name exactly, or as a prefix followed by one of these
# (so "gsm8k_train" and "math_dapo/train" match, "gsm8kx" does not match "gsm8k").
_PREFIX_SEPARATORS = "/_-:."


@dataclass(frozen=True)
class RuleReward:
    name: str
    sources: tuple[str, ...]
    """Lower-case data_source names (or prefixes) this rule scores."""
    score: Callable[..., float | dict]
    """(solution_str, ground_truth, **options) -> score, or a dict with "score" and extras; options are the
    rule's own settings (e.g. `method`)."""
    oracle: Callable[[str], str]
    """ground_truth -> a response that scores 1.0."""
    answer: Callable[..., str | None] | None = None
    """(solution_str, **options) -> the normalised final answer the rule would compare, None if there is none
    (for majority votes in validation); None when the rule defines no answer."""
    exact_sources: tuple[str, ...] = ()
    """data_source names this rule scores only when given exactly, case included (never as a prefix): a short
    generic name such as "math" would otherwise also claim "MATH", "math_*" and "math/*" sources, which may
    hold other answer formats."""


_RULES: dict[str, RuleReward] = {}


def register_rule(
    name: str,
    sources: tuple[str, ...],
    oracle: Callable[[str], str],
    answer: Callable[..., str | None] | None = None,
    exact_sources: tuple[str, ...] = (),
):
    """Decorator: register `score(solution_str, ground_truth, **options) -> float | dict` for `sources` (exact
    names or prefixes) and `exact_sources` (exact names only)."""

    def wrap(score: Callable[..., float | dict]) -> Callable[..., float | dict]:
        mine = tuple(source.lower() for source in sources)
        taken = {source.lower() for rule in _RULES.values() for source in rule.sources + rule.exact_sources}
        clash = taken & {*mine, *(source.lower() for source in exact_sources)}
        if name in _RULES or clash:
            raise ValueError(f"rule reward {name!r} clashes with an existing registration ({clash or name})")
        _RULES[name] = RuleReward(name, mine, score, oracle, answer, tuple(exact_sources))
        return score

    return wrap


def known_sources() -> list[str]:
    """Every registered name; those matched only exactly are marked `(exact)`."""
    names = [source for rule in _RULES.values() for source in rule.sources]
    names += [f"{source} (exact)" for rule in _RULES.values() for source in rule.exact_sources]
    return sorted(names)


def find_rule(data_source: str) -> RuleReward | None:
    """The rule for `data_source`: an exact-only name as given, else (case-insensitive) an exact name, else the
    longest matching prefix."""
    for rule in _RULES.values():
        if data_source in rule.exact_sources:
            return rule
    key = data_source.lower()
    best, best_len = None, -1
    for rule in _RULES.values():
        for source in rule.sources:
            exact = key == source
            prefix = key.startswith(source) and key[len(source) : len(source) + 1] in tuple(
                _PREFIX_SEPARATORS
            )
            if exact:
                return rule
            if prefix and len(source) > best_len:
                best, best_len = rule, len(source)
    return best


def get_rule(data_source: str) -> RuleReward:
    """Like `find_rule`, but an unknown data_source raises ValueError listing the known names."""
    rule = find_rule(data_source)
    if rule is None:
        raise RewardFnError(
            f"no built-in reward for data_source={data_source!r}; known (exact or as a prefix, those marked "
            f"(exact) only exactly): {known_sources()}. "
            "Fix: set reward.fn=module:function or reward.fn=path/to/file.py:function with "
            "fn(data_source, solution_str, ground_truth, extra_info) -> float"
        )
    return rule


def rule_reward(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    options: Mapping[str, Mapping[str, str]] | None = None,
) -> float | dict:
    """The built-in reward: dispatch on data_source (the function used when reward.fn is empty): the rule's
    float, or its dict with "score" and extras (`rule_score` takes the score alone); `options` maps a rule
    name to its keyword settings, e.g. {"gsm8k": {"method": "strict"}}."""
    rule = get_rule(data_source)
    return rule.score(solution_str, ground_truth, **(options or {}).get(rule.name, {}))


def rule_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    options: Mapping[str, Mapping[str, str]] | None = None,
) -> float:
    """`rule_reward`'s score alone, whether the rule returns a float or a dict."""
    out = rule_reward(data_source, solution_str, ground_truth, extra_info, options)
    return out["score"] if isinstance(out, Mapping) else out


def rule_answer(
    data_source: str, solution_str: str, options: Mapping[str, Mapping[str, str]] | None = None
) -> str | None:
    """The final answer the built-in rule for `data_source` reads from `solution_str` (None: no answer, or a rule
    that defines none); `options` as for `rule_reward`."""
    rule = find_rule(data_source)
    if rule is None or rule.answer is None:
        return None
    return rule.answer(solution_str, **(options or {}).get(rule.name, {}))
