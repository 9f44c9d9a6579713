"""What the phases of one step share: the rank's components, the micro-batcher, the step index, the phase
timer and the rollout engine's statistics of the step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.metrics import PhaseTimer
from engine.roles.dynamic_batch import MicroBatcher

if TYPE_CHECKING:
    from engine.setup import Components


@dataclass
class StepContext:
    c: Components
    batcher: MicroBatcher
    step: int
    """The index of the step being run (0 for the first)."""
    timer: PhaseTimer
    engine_stats: dict[str, float] = field(default_factory=dict)
    """This rank's rollout engine statistics of the step (`add_engine_stats`)."""
    multi_turn: dict[str, float] = field(default_factory=dict)
    """This replica's totals over the step's training episodes (`add_episodes`; empty without multi-turn)."""

    def add_engine_stats(self, stats: dict) -> None:
        """Keep the rollout engine's statistics of one call for the step's metrics (`rollout_engine/<key>`):
        seconds (keys ending in `_s`, e.g. vLLM's `wake_load_s` and `sleep_s`) add up over the step's calls,
        counts are the last call's (native: `decode_steps`, `compactions`, `chunks`, ...)."""
        merge_engine_stats(self.engine_stats, stats)

    def add_episodes(self, episodes: list, tool_s: float) -> None:
        """Count one training rollout's episodes (the replica's: every rank of it holds all of them) and the
        seconds this rank spent in tool calls; dynamic-sampling rounds add up."""
        self.add_episode_totals(episode_totals(episodes, tool_s))

    def add_episode_totals(self, totals: dict[str, float]) -> None:
        """Add `episode_totals` of some training episodes (under split placement: those the rollout ranks
        counted, engine/split/link.py `TrainerLink.collect`)."""
        for key, value in totals.items():
            self.multi_turn[key] = self.multi_turn.get(key, 0.0) + float(value)


def episode_totals(episodes: list, tool_s: float) -> dict[str, float]:
    """The counts `multi_turn/*` sums over a step's training episodes (engine/step/stats.py
    `multi_turn_metrics`): episodes, assistant turns, tool calls, failed tool calls, and `tool_s` seconds."""
    return {
        "episodes": float(len(episodes)),
        "turns": float(sum(e.num_assistant_turns for e in episodes)),
        "tool_calls": float(sum(e.num_tool_calls for e in episodes)),
        "tool_errors": float(sum(e.num_tool_errors for e in episodes)),
        "tool_s": float(tool_s),
    }


def merge_engine_stats(into: dict[str, float], stats: dict) -> None:
    """Add one rollout-engine call's `stats` to `into` as `StepContext.add_engine_stats` describes."""
    for key, value in stats.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            name = f"rollout_engine/{key}"
            add = key.endswith("_s") and name in into
            into[name] = float(value) + (into[name] if add else 0.0)
