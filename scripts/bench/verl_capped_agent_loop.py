"""verl 0.9.1's single-turn agent loop with a per-row response cap (scripts/bench/verl_grpo.py registers it).

The row's `extra_info["max_tokens"]` (the workload's cap) goes into the request's sampling params as
`max_tokens`, which verl's vLLM server passes to vLLM's `SamplingParams` per request; the rollout's
`ignore_eos=true` then makes every response exactly its cap. Imported by verl's agent-loop workers only.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


class CappedSingleTurnAgentLoop(SingleTurnAgentLoop):
    """SingleTurnAgentLoop whose requests carry the row's `extra_info["max_tokens"]`."""

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs):
        cap = (kwargs.get("extra_info") or {}).get("max_tokens")
        if cap is not None:
            sampling_params = {**sampling_params, "max_tokens": int(cap)}
        return await super().run(sampling_params, priority=priority, **kwargs)
