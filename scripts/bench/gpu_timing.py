"""CUDA-event timers shared by the kernel benchmarks (decode_attention.py, decode_attention_widths.py,
decode_gemms.py, sampler.py)."""

from __future__ import annotations

import statistics

import torch


def event_ms(fn) -> float:
    """GPU milliseconds between CUDA events recorded around one `fn()` (synchronised)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def eager_ms(fn, iters: int) -> float:
    """Median milliseconds of `iters` eager calls after 3 warm-up calls: host launch time counts wherever the
    host is slower than the kernels."""
    for _ in range(3):
        fn()
    return statistics.median(event_ms(fn) for _ in range(iters))


def graph_ms(fn, iters: int = 15, reps: int = 20) -> float:
    """Median milliseconds of one `fn()` over `iters` replays of a CUDA graph of `reps` calls (warmed up on a
    side stream first): the kernels' own time with the gaps between them, as inside the engine's decode
    graphs. `fn` must be capturable (no host syncs, no unregistered random generators)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return statistics.median(event_ms(graph.replay) for _ in range(iters)) / reps
