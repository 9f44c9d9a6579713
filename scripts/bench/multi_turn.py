"""Benchmark multi-turn rollouts with a synthetic tool: episodes/s and generated tokens/s of the episode loop
(engine/multi_turn/episode.py) on the native engine and vLLM, same random-init model and prompts; prints one
JSON object.

    python scripts/bench/multi_turn.py --preset qwen2_5_1_5b     # GPU: 256 prompts x 4 turns of 128 tokens
    python scripts/bench/multi_turn.py --preset tiny             # CPU smoke test (16 prompts x 3 turns of 16)

Model and weights as scripts/bench/rollout.py (a conf/model preset, random init in the rollout layout). Every
assistant turn is --turn-tokens long (EOS ignored) and calls the synthetic tool, which answers after
--tool-latency-ms with a fixed --tool-result-chars string, rendered by the embedded character-level chat
template (engine/tasks/embedded.py); so every episode has exactly --turns assistant turns and the backends do
the same work. Generated ids are shown to the tokenizer modulo its vocabulary (only the tool turns' text
matters here). The native engine keeps each episode's K/V across turns and prefills only the tool turn
(`native_reprefill`: it prefills each turn's prompt in full); vLLM keeps the episode's KV blocks through
prefix caching while it stays awake across the turns (`RolloutEngine.hold`). Timed: one `EpisodeRunner.run`
after a warm-up of whole episodes of 8-token turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import traceback
from dataclasses import replace

import torch
from rollout import synced
from rollout_models import PRESETS, model_shape, random_rollout_weights  # scripts/bench/ is the script's dir

from engine.config import MultiTurnConfig
from engine.data import load_tokenizer
from engine.multi_turn.episode import EpisodeRunner
from engine.multi_turn.parsers import register_tool_format
from engine.multi_turn.tools import Tool, ToolCall
from engine.rollout.base import SamplingParams
from engine.step.batch import response_lengths
from engine.tasks.embedded import build_embedded_tokenizer
from parallel.dims import ParallelDims
from parallel.state import destroy_distributed, init_distributed


class SyntheticTool(Tool):
    name = "synthetic"
    description = "Answers with a fixed string after a fixed delay."
    parameters = {"type": "object", "properties": {}, "required": []}

    def __init__(self, latency_s: float, result_chars: int):
        self.latency_s, self.result = latency_s, ("0123456789" * (result_chars // 10 + 1))[:result_chars]

    async def call(self, args: dict) -> str:
        await asyncio.sleep(self.latency_s)
        return self.result


@register_tool_format("bench_every_turn")
def _every_turn(text: str, tools: list[Tool]) -> list[ToolCall]:
    return [ToolCall(tools[0].name, {})]


class ModuloTokenizer:
    """The embedded tokenizer, decoding any model id modulo its vocabulary (the bench's model is larger)."""

    def __init__(self, inner):
        self.inner = inner

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        size = len(self.inner)
        return self.inner.decode([i % size for i in ids], skip_special_tokens=skip_special_tokens)

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=PRESETS, default="tiny")
    ap.add_argument(
        "--backends",
        default="native,native_reprefill,vllm",
        help="comma-separated: native, native_reprefill (no KV cache kept across turns), vllm",
    )
    ap.add_argument("--prompts", type=int, help="default 256 (16 for tiny)")
    ap.add_argument("--prompt-len", type=int, help="default 256 (16 for tiny)")
    ap.add_argument("--turns", type=int, help="assistant turns per episode; default 4 (3 for tiny)")
    ap.add_argument("--turn-tokens", type=int, help="tokens per assistant turn; default 128 (16 for tiny)")
    ap.add_argument("--tool-result-chars", type=int, default=32)
    ap.add_argument("--tool-latency-ms", type=float, default=0.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45, help="vLLM")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON here")
    return ap.parse_args()


def make_engine(name: str, shape, device, args):
    if name in ("native", "native_reprefill"):
        from engine.rollout.native import NativeRollout

        keep = name == "native"
        return NativeRollout(shape, device, max_num_seqs=args.prompts, keep_episode_cache=keep)
    if device.type != "cuda":
        return None
    from engine.rollout.vllm_backend import VllmRollout

    return VllmRollout(
        shape, device, 1, max_num_seqs=args.prompts, gpu_memory_utilization=args.gpu_memory_utilization
    )


def run_backend(name, shape, weights, runner, prompts, sampling, device, args) -> dict:
    try:
        engine = make_engine(name, shape, device, args)
    except ImportError as err:
        return {"skipped": str(err)}
    if engine is None:
        return {"skipped": f"{name} runs on CUDA only"}
    engine.set_weights(weights)
    # warm-up: whole episodes of 8-token turns (every call the timed run makes, at other lengths: the native
    # engine compiles its kernels once per process, as vLLM compiles at its start)
    runner.run(engine, prompts, replace(sampling, max_new_tokens=8))
    start, cpu = synced(device), time.process_time()
    out = runner.run(engine, prompts, sampling)
    seconds, cpu_s = synced(device) - start, time.process_time() - cpu
    generated = int(out.response_mask.sum())
    context = int(response_lengths(out.response_mask).sum())
    return {
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu_s, 3),
        "episodes": out.response_ids.shape[0],
        "episodes_per_s": round(out.response_ids.shape[0] / seconds, 2),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / seconds, 1),
        "tool_tokens": context - generated,
        "episode_stats": runner.last_stats,
        "engine_stats": {k: v for k, v in engine.last_stats.items() if isinstance(v, (int, float))},
    }


def main() -> None:
    args = parse_args()
    tiny = args.preset == "tiny"
    args.prompts = args.prompts or (16 if tiny else 256)
    args.prompt_len = args.prompt_len or (16 if tiny else 256)
    args.turns = args.turns or (3 if tiny else 4)
    args.turn_tokens = args.turn_tokens or (16 if tiny else 128)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    groups = init_distributed(ParallelDims(world_size=1), device_type)  # vLLM joins this world
    device = groups.device
    shape = model_shape(args.preset)
    weights = random_rollout_weights(shape, device, args.seed)
    tokenizer = ModuloTokenizer(
        load_tokenizer(build_embedded_tokenizer(tempfile.mkdtemp(prefix="bench-tok-")))
    )
    tool = SyntheticTool(args.tool_latency_ms / 1000, args.tool_result_chars)
    probe = EpisodeRunner(MultiTurnConfig(tool_format="bench_every_turn"), tokenizer, {}, 1, 0)
    tool_turn = len(probe.renderer.tool_turn_ids([tool.result], stopped=False))  # turns end by their limit
    total = args.turns * args.turn_tokens + (args.turns - 1) * tool_turn
    cfg = MultiTurnConfig(
        enable=True, max_turns=args.turns, max_total_tokens=total, tool_format="bench_every_turn"
    )
    runner = EpisodeRunner(cfg, tokenizer, {tool.name: tool}, shape.max_position_embeddings, 0)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, shape.vocab_size, (args.prompts, args.prompt_len), generator=gen).tolist()
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=args.turn_tokens, ignore_eos=True, seed=args.seed, log_probs=True
    )
    report = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "turns": args.turns,
        "turn_tokens": args.turn_tokens,
        "tool_turn_tokens": tool_turn,
        "tool_latency_ms": args.tool_latency_ms,
        "results": {},
    }
    for name in args.backends.split(","):
        try:
            report["results"][name] = run_backend(
                name, shape, weights, runner, prompts, sampling, device, args
            )
        except Exception as err:  # report and still measure the others
            traceback.print_exc()
            report["results"][name] = {"error": f"{type(err).__name__}: {err}"[:2000]}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    line = json.dumps(report)
    print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    destroy_distributed()
    os.environ.pop("MASTER_PORT", None)


if __name__ == "__main__":
    main()
