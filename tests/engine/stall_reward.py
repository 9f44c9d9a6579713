"""A user reward (reward.fn) equal to the built-in rule that, when STALL_AFTER_CHECKPOINT names a checkpoint
directory that exists, writes `<it>.stalled` and sleeps: a run that is mid-step, deterministically, for a
test to kill (tests/engine/test_kill_resume.py)."""

from __future__ import annotations

import os
import time

from engine.rewards.registry import rule_reward


def score(data_source, solution_str, ground_truth, extra_info):
    stall_at = os.environ.get("STALL_AFTER_CHECKPOINT", "")
    if stall_at and os.path.isdir(stall_at):
        open(stall_at + ".stalled", "w").close()
        time.sleep(600)
    return rule_reward(data_source, solution_str, ground_truth, extra_info)
