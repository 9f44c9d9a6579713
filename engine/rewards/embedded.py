"""Rewards of the embedded tasks (`engine.tasks.embedded`): fraction of positions correct.

Partial credit makes learning visible early on a tiny model. The multi-turn `calculator` task scores the whole
episode (`calculator_score`). The response is compared with the ground
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


def calculator_turns(solution_str: str) -> tuple[str | None, str]:
    """(the expression of the episode's first-turn call or None, the final answer) of a calculator episode's
    text: `#48+39\nt:87\na:87` (the embedded chat template's tool turn, special tokens skipped)."""
    call = solution_str.split("\n", 1)[0][1:] if solution_str.startswith("#") else None
    answer = solution_str.rsplit("\na:", 1)[-1] if "\na:" in solution_str else solution_str
    return call, answer.strip()


@register_rule(
    "embedded_calculator",
    sources=("embedded/calculator",),
    oracle=lambda truth: "#{0}\nt:{1}\na:{1}".format(*truth.split("=")),
    answer=lambda solution_str: calculator_turns(solution_str)[1] or None,
)
def calculator_score(solution_str: str, ground_truth: str) -> float:
    """Half for calling the calculator on the prompt's expression, half for answering with the sum (each by
    positions correct), and nothing for an episode that does not call the calculator first (the task is
    arithmetic a tiny model can only do with the tool): ground truth `48+39=87`."""
    expression, _, total = ground_truth.partition("=")
    call, answer = calculator_turns(solution_str)
    if call is None:
        return 0.0
    return 0.5 * positional_score(call, expression) + 0.5 * positional_score(answer, total)
