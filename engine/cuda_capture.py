"""Capturing a CUDA graph on a side stream: what the native engine's decode graphs (engine/rollout/cuda_graphs.py)
and the training layers' graphs (engine/models/layer_graphs.py) share."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def capturing_on(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream, device: torch.device):
    """Capture the work issued inside into `graph` (its memory from `pool`) on `stream`, which first waits for
    `device`'s current stream; that stream waits for `stream` afterwards. `capture_begin`/`capture_end`, not
    the `torch.cuda.graph` context: its `gc.collect()` and `empty_cache()` on entry cost ~0.1 s with a large
    Python heap, paid for every graph captured. Capturing runs nothing: the caller replays."""
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                yield
            finally:
                graph.capture_end()
    finally:
        current.wait_stream(stream)
