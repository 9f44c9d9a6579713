"""Rewards computed from decoded responses: rule rewards by `data_source`, or the user's `reward.fn`.

Importing the package registers the built-in rules (gsm8k, boxed math, embedded tasks).
"""

from engine.rewards import boxed_math, embedded, gsm8k  # noqa: F401  (register the rules)
from engine.rewards.registry import (
    find_rule,
    get_rule,
    known_sources,
    register_rule,
    rule_answer,
    rule_reward,
)
from engine.rewards.reward_fn import RewardFn, RewardResult, build_reward_fn, load_user_fn

__all__ = [
    "RewardFn",
    "RewardResult",
    "build_reward_fn",
    "find_rule",
    "get_rule",
    "known_sources",
    "load_user_fn",
    "register_rule",
    "rule_answer",
    "rule_reward",
]
