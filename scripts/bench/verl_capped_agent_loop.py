"""verl 0.9.1's single-turn agent loop with a per-row response cap (scripts/bench/verl_grpo.py registers it).

The row's `extra_info["max_tokens"]` (the workload's cap) goes into the request's sampling params as
`max_tokens`, which verl's vLLM server passes to vLLM's `SamplingParams` per request; the rollout's
`ignore_eos=true` then makes every response exactly its cap. Imported by verl's agent-loop workers only.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


class CappedSingleTurnAgentLoop(SingleTurnAgentLoop):
    """SingleTurnAgentLoop whose requests carry the row's `extra_info["max_tokens"]`.

    verl picks its Continuous Token builder from the model's `model_type` (qwen2: ChatML boundaries, which
    need `<|im_end|>` and a one-token newline); the benchmark's character-level tokenizer and template are not
    ChatML, so the loop takes verl's default builder (what verl uses for a model type it does not know)."""

    def __init__(self, *args, hf_model_type: str | None = None, **kwargs):
        super().__init__(*args, hf_model_type=None, **kwargs)

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs):
        cap = (kwargs.get("extra_info") or {}).get("max_tokens")
        if cap is not None:
            sampling_params = {**sampling_params, "max_tokens": int(cap)}
        return await super().run(sampling_params, priority=priority, **kwargs)
