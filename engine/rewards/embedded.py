"""Rewards of the embedded tasks (`engine.tasks.embedded`): fraction of positions correct.

Partial credit makes learning visible early on a tiny model. The response is compared with the ground
truth position by position after stripping surrounding whitespace; extra or missing characters count as
wrong (score = matches / max(len(response), len(ground_truth))).
"""

from __future__ import annotations

from engine.rewards.registry import register_rule


@register_rule(
    "embedded",
    sources=("embedded/copy", "embedded/target"),
    oracle=lambda truth: truth,
    answer=lambda solution_str: solution_str.strip() or None,
)
def positional_score(solution_str: str, ground_truth: str) -> float:
    response, truth = solution_str.strip(), ground_truth.strip()
    if not truth:
        raise ValueError("embedded ground truth is empty")
    matches = sum(a == b for a, b in zip(response, truth))
    return matches / max(len(response), len(truth))
