"""CUDA graphs of the native engine's decode step, one per batch-size bucket.

A graph records the kernels of one `RolloutModel.decode` call on static tensors: the token, padding and
position buffers, the KV cache views and the weights. Replaying it costs one launch instead of a few hundred
(decode at small batch is launch-bound). It is valid only while every one of those tensors keeps its address,
so the set of graphs is keyed by the weights' data pointers and the KV buffer's version, and dropped as soon
as either changes (after a weight transition that moved the weights, or a cache re-allocation).

Buckets: 1, 2, 4, then powers of two and 1.5x powers of two up to the engine's slot count (plus the slot
count itself): at most 1.5x padding rows, ~2 log2(slots) graphs, captured lazily on first use.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.cuda_capture import capturing_on


def batch_buckets(slots: int) -> list[int]:
    """Sorted batch sizes a graph is captured for, the largest being `slots`."""
    sizes = {1, 2, 4}
    p = 4
    while p < slots:
        sizes.update((p, p * 3 // 2, p * 2))
        p *= 2
    return sorted({s for s in sizes if s < slots} | {slots})


def bucket_for(width: int, buckets: list[int]) -> int:
    """The smallest bucket holding `width` rows."""
    for b in buckets:
        if b >= width:
            return b
    raise ValueError(f"{width} rows exceed the largest bucket {buckets[-1]}")


class DecodeGraphs:
    """Captured decode steps keyed by bucket; `run(bucket, step)` replays (capturing first if needed).

    `step(bucket)` must compute the decode step for the first `bucket` rows of the static buffers and return
    the logits; `prepare_capture()` / `finish_capture()` bracket the warm-up and capture (the engine points the
    position buffer at a cache position no real step reads before writing).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._key: tuple | None = None
        self._pool = None
        self.capture_seconds: dict[int, float] = {}
        """Host seconds of each bucket's warm-up and capture (Triton/Inductor compiles included), the GPU drained
        before and after; the owner empties it (engine/rollout/native.py: per generate call)."""

    def invalidate_unless(self, key: tuple) -> None:
        """Drop every graph unless they were captured under `key` (weights' pointers, cache version, ...)."""
        if key != self._key:
            self.clear()
            self._key = key

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None
        self._key = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(
        self,
        bucket: int,
        step: Callable[[int], torch.Tensor],
        prepare_capture: Callable[[], None],
        finish_capture: Callable[[], None],
    ) -> torch.Tensor:
        if bucket not in self._graphs:
            torch.cuda.synchronize(self.device)  # (the capture waits for the queued steps anyway)
            start = time.perf_counter()
            prepare_capture()
            try:
                self._graphs[bucket] = self._capture(bucket, step)
            finally:
                finish_capture()
            torch.cuda.synchronize(self.device)
            took = time.perf_counter() - start
            self.capture_seconds[bucket] = self.capture_seconds.get(bucket, 0.0) + took
        graph, out = self._graphs[bucket]
        graph.replay()
        return out

    def _capture(self, bucket: int, step: Callable[[int], torch.Tensor]):
        """Warm up on a side stream (cuBLAS/NCCL state is set up outside the capture), then capture there
        (engine/cuda_capture.py)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                step(bucket)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with capturing_on(graph, self._pool, side, self.device):
            out = step(bucket)
        return graph, out
