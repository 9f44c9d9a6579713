"""The native engine's KV cache: one preallocated buffer, sized from a memory budget, viewed per rollout call as
(slots, seq_len, groups, head_dim) K and V tensors for every layer (a row's positions contiguous: the flash
decode kernel reads them in place, engine/rollout/model.py).

The budget decides how many sequences decode at once (`max_slots`); the engine chunks a larger batch instead
of allocating more. Calls whose rows finish at different times view it as flat pages instead (`flat_views`,
engine/rollout/paged_kv.py), so that a row holds only the positions it has written. The buffer is kept
between calls (and only re-allocated when a call needs more than it holds) unless released, so a CUDA graph captured on its views stays valid for as long as it lives: `version`
changes whenever the storage does. Finished sequences are removed by `compact`, which moves the live rows
to the front (one copy of the live part, done only when enough rows finished: see native.py).
"""

from __future__ import annotations

import torch

CPU_BUDGET_BYTES = 1 << 30
"""Cap on CPU: the buffer grows to what a call needs, up to this."""


class KVCachePool:
    """K/V storage for `num_layers` layers of `groups` KV heads of `head_dim` (this rank's TP share)."""

    def __init__(
        self,
        num_layers: int,
        groups: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        budget_bytes: int | None = None,
        memory_fraction: float = 0.5,
    ):
        self.num_layers, self.groups, self.head_dim = num_layers, groups, head_dim
        self.dtype, self.device = dtype, device
        self._budget = budget_bytes
        self.memory_fraction = memory_fraction
        self._buf: torch.Tensor | None = None
        self.version = 0

    def budget_bytes(self) -> int:
        """The configured budget; on CUDA by default `memory_fraction` of the memory free now (plus ours)."""
        if self._budget is not None:
            return self._budget
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            held = 0 if self._buf is None else self._buf.numel() * self._buf.element_size()
            return int((free + held) * self.memory_fraction)
        return CPU_BUDGET_BYTES

    def bytes_per_sequence(self, seq_len: int) -> int:
        """K and V of every layer for one sequence of `seq_len` positions."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.groups * seq_len * self.head_dim * elem

    def max_slots(self, seq_len: int) -> int:
        """Sequences of `seq_len` positions the budget holds at once."""
        return self.budget_bytes() // self.bytes_per_sequence(seq_len)

    def views(self, slots: int, seq_len: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V views (slots, seq_len, groups, head_dim) of the buffer (grown if too small)."""
        return self._layer_views((slots, seq_len))

    def flat_views(self, positions: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V views (positions, groups, head_dim) of the buffer (grown if too small): a paged
        call's pages (engine/rollout/paged_kv.py)."""
        return self._layer_views((positions,))

    def bytes_per_position(self) -> int:
        return self.bytes_per_sequence(1)

    def max_positions(self) -> int:
        """Positions (of every layer's K and V) the budget holds."""
        return self.budget_bytes() // self.bytes_per_position()

    def _layer_views(self, rows: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A new buffer is zero-filled: masked cache positions are multiplied by a zero attention weight, and
        0 * NaN would be NaN."""
        shape = (self.num_layers, 2, *rows, self.groups, self.head_dim)
        numel = 1
        for d in shape:
            numel *= d
        if self._buf is None or self._buf.numel() < numel:
            self._buf = None  # free the old buffer before allocating the new one
            self._buf = torch.zeros(numel, dtype=self.dtype, device=self.device)
            self.version += 1
        layers = self._buf[:numel].view(shape)
        return [layers[i, 0] for i in range(self.num_layers)], [layers[i, 1] for i in range(self.num_layers)]

    def allocated_bytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()

    def release(self) -> None:
        """Drop the buffer (the next `views` allocates a new one)."""
        if self._buf is not None:
            self._buf = None
            self.version += 1


def compact_rows(
    cache_k: list[torch.Tensor], cache_v: list[torch.Tensor], keep: torch.Tensor, num_positions: int
) -> None:
    """Move rows `keep` (ascending indices) of every layer's K/V to rows [0, len(keep)), positions
    [0, num_positions) only (the rest is unwritten)."""
    n = keep.numel()
    for cache in (*cache_k, *cache_v):
        cache[:n, :num_positions] = cache[keep, :num_positions]
