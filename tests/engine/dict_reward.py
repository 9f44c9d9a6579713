"""A user reward (reward.fn) returning verl's dict form: the built-in rule's score, a numeric extra `acc`
(twice the score, so its logged mean is checkable against reward/mean) and a non-numeric `note` (ignored)
(tests/engine/test_trainer_presets.py)."""

from __future__ import annotations

from engine.rewards.registry import rule_score


def score(data_source, solution_str, ground_truth, extra_info):
    s = rule_score(data_source, solution_str, ground_truth, extra_info)
    return {"score": s, "acc": 2.0 * s, "note": "x"}
