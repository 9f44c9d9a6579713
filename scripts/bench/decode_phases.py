"""Where one native `generate` call's GPU timeline goes, by phase; prints one JSON object (GPU only).

    python scripts/bench/decode_phases.py --preset qwen2_5_1_5b                         # 512 x 256 -> 512
    python scripts/bench/decode_phases.py --preset qwen2_5_1_5b --prompts 24 --prompt-len 3840

The timed call follows a warm-up call of the same batch; it allocates its KV cache and captures its CUDA
graphs, as every rollout does (the engine frees both after each call on CUDA). CUDA events on the engine's
stream bracket each phase, so each span is GPU time from the phase's first enqueued work to its last, idle
gaps inside included:
- `prefill_ms`: the prompts' forwards (engine/rollout/prefill.py `prefill_rows`);
- `capture_ms`: the CUDA-graph warm-up and capture of each batch bucket (engine/rollout/cuda_graphs.py);
- `replay_ms`: the decode steps' graph replays; `sample_ms`: the draw and the per-step bookkeeping after each
  (engine/rollout/decode_state.py `record_tokens`);
- `other_ms`: the rest of the call's span (compaction, host checks, outputs, waits for the host).
Then the decode graph of the call's widest bucket alone, replayed `--replays` times back to back
(`graph_step_ms`, so the gaps between the graph's kernels count) and under torch.profiler
(`graph_kernels_ms`: the sum of its kernels' own times), at the call's final state: every row has finished,
so each reads one key and the figure is a decode step without its attention. Their difference is the time the
GPU spends between a step's kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager

import torch
from gpu_timing import event_ms  # scripts/bench/ is on sys.path
from profiling import device_us
from rollout_models import model_shape, random_rollout_weights

from engine.rollout import native
from engine.rollout.base import SamplingParams
from engine.rollout.cuda_graphs import DecodeGraphs

PHASES = ("prefill", "capture", "replay", "sample")


class Spans:
    """(start, end) CUDA event pairs per phase, recorded on the current stream."""

    def __init__(self):
        self.events: dict[str, list] = {p: [] for p in PHASES}

    @contextmanager
    def span(self, phase: str):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        try:
            yield
        finally:
            b.record()
            self.events[phase].append((a, b))

    @contextmanager
    def wrapped(self, owner, name: str, phase: str):
        """`owner.name` bracketed by this phase's events inside the block."""
        had, inner = name in vars(owner), getattr(owner, name)

        def timed(*args, **kwargs):
            with self.span(phase):
                return inner(*args, **kwargs)

        setattr(owner, name, timed)
        try:
            yield
        finally:
            if had:
                setattr(owner, name, inner)
            else:
                delattr(owner, name)

    def totals_ms(self) -> dict[str, float]:
        return {p + "_ms": sum(a.elapsed_time(b) for a, b in pairs) for p, pairs in self.events.items()}


def graph_alone(engine, replays: int) -> dict:
    """The widest captured decode graph replayed back to back: ms per step by CUDA events, and its kernels'
    own time per step under torch.profiler."""
    width = max(engine.graphs._graphs)
    graph, _ = engine.graphs._graphs[width]
    for _ in range(3):
        graph.replay()

    def back_to_back():
        for _ in range(replays):
            graph.replay()

    times = [event_ms(back_to_back) / replays for _ in range(5)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        back_to_back()
        torch.cuda.synchronize()
    kernels_us = sum(
        device_us(e) for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    step = statistics.median(times)
    kernels = kernels_us / 1e3 / replays
    return {
        "width": width,
        "graph_step_ms": round(step, 4),
        "graph_kernels_ms": round(kernels, 4),
        "graph_gap_fraction": round(1 - kernels / step, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2_5_1_5b")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = torch.device("cuda")
    shape = model_shape(args.preset)
    weights = random_rollout_weights(shape, device, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, shape.vocab_size, (args.prompts, args.prompt_len), generator=gen).tolist()
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=args.seed
    )
    engine = native.NativeRollout(shape, device, args.prompts, keep_cache=True)
    engine.set_weights(weights)
    engine.generate(prompts, sampling)  # compiles every kernel of this shape once
    engine.release()  # the timed call allocates its cache and captures its graphs, as a rollout does
    spans = Spans()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with (
        spans.wrapped(native, "prefill_rows", "prefill"),
        spans.wrapped(native, "record_tokens", "sample"),
        spans.wrapped(DecodeGraphs, "_capture", "capture"),
        spans.wrapped(torch.cuda.CUDAGraph, "replay", "replay"),
    ):
        torch.cuda.synchronize()
        start = time.perf_counter()
        begin.record()
        engine.generate(prompts, sampling)
        end.record()
        end.synchronize()
        seconds = time.perf_counter() - start
    result = {"preset": args.preset, "prompts": args.prompts, "prompt_len": args.prompt_len}
    result.update(new_tokens=args.new_tokens, seconds=round(seconds, 4), device=torch.cuda.get_device_name())
    phases = spans.totals_ms()
    span_ms = begin.elapsed_time(end)
    result["span_ms"] = round(span_ms, 2)
    result.update({k: round(v, 2) for k, v in phases.items()})
    result["other_ms"] = round(span_ms - sum(phases.values()), 2)
    result["decode_steps"] = engine.last_stats["decode_steps"]
    result["replay_ms_per_step"] = round(phases["replay_ms"] / max(1, len(spans.events["replay"])), 4)
    result["sample_ms_per_step"] = round(phases["sample_ms"] / max(1, len(spans.events["sample"])), 4)
    result.update(graph_alone(engine, args.replays))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
