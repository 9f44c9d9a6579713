"""Build the trainer's reward function from `reward.*`: the built-in rules, the user's function in this
process, or the user's function in a child process with a time limit (engine/rewards/worker.py)."""

from __future__ import annotations

import functools

from engine.rewards.registry import rule_reward
from engine.rewards.reward_fn import BUILTIN_NAME, RewardFn, load_user_fn, user_fn_name
from engine.rewards.worker import ProcessRewardFn


def build_reward_fn(fn_spec: str = "", gsm8k_method: str = "strict", timeout_s: float = 0.0) -> RewardFn:
    """`reward.fn` -> RewardFn; empty means the built-in rules dispatched by data_source (in this process),
    GSM8K read with `gsm8k_method` (`reward.gsm8k_method`).

    With `timeout_s` > 0 a user function runs in a child process that is stopped when one batch takes longer
    (`engine.rewards.worker`); with 0 it runs in this process, without a limit.
    """
    if not fn_spec or not fn_spec.strip():
        options = {"gsm8k": {"method": gsm8k_method}}
        return RewardFn(functools.partial(rule_reward, options=options), BUILTIN_NAME, builtin=True)
    if timeout_s > 0:
        return ProcessRewardFn(fn_spec, timeout_s)
    return RewardFn(load_user_fn(fn_spec), user_fn_name(fn_spec))
