"""Rank math of the training layout (tp, pp, dp, vpp), its groups and layers, and how parameters split over TP.

Pure integers and ranges. This module must not import torch or torch.distributed, nor create process
groups: `parallel/state.py` turns the group lists into process groups. The rollout layout and the slices that
move between the two layouts are in `parallel/hybrid_layout.py`; layers per stage in `parallel/stage_layers.py`.

Training layout (t = tp, p = pp, d = dp, vpp) follows megatron-core's default order "tp-cp-ep-dp-pp"
with cp = ep = 1, so `rank = tp_rank + t * (dp_rank + d * pp_rank)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from parallel.stage_layers import check_stage_layer_keys, chunk_layers, stage_layer_counts


class PartitionKind(str, Enum):
    """How megatron splits a parameter over TP ranks."""

    REPLICATED = "replicated"  # norms, row-parallel biases: every TP rank holds the full tensor
    COLUMN = "column"  # dim 0: QKV (interleaved per query group), column biases, embedding, output layer
    ROW = "row"  # dim 1: linear_proj, linear_fc2
    COLUMN_GATED = "column_gated"  # dim 0, SwiGLU linear_fc1 stored per shard as [gate_i; up_i]


def divisors(n: int) -> list[int]:
    """The positive divisors of `n`, ascending (the sizes an error message can suggest)."""
    return [x for x in range(1, n + 1) if n % x == 0]


def check_positive(key: str, value: int) -> None:
    """ValueError naming `key` unless `value` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r} must be a positive integer; use {key}=1 for no parallelism")


def group_by(num_ranks: int, key: Callable[[int], tuple], order: Callable[[int], int]) -> list[list[int]]:
    """Ranks with equal `key` form a group, sorted by `order`; groups sorted by their first member."""
    groups: dict[tuple, list[int]] = {}
    for rank in range(num_ranks):
        groups.setdefault(key(rank), []).append(rank)
    return sorted((sorted(g, key=order) for g in groups.values()), key=lambda g: g[0])


@dataclass(frozen=True)
class TrainCoords:
    """Where a rank sits in the training layout."""

    tp_rank: int
    """Tensor-parallel rank, 0..tp-1."""
    pp_rank: int
    """Pipeline stage, 0..pp-1."""
    dp_rank: int
    """Data-parallel replica, 0..dp-1."""


@dataclass(frozen=True)
class TrainLayout:
    """Training layout over tp*pp*dp ranks in megatron-core's default order tp-cp-ep-dp-pp (cp = ep = 1)."""

    tp: int
    """Tensor-parallel size t (`parallel.tp`)."""
    pp: int
    """Pipeline-parallel size p (`parallel.pp`)."""
    dp: int
    """Data-parallel size d (world size / (parallel.tp * parallel.pp))."""
    vpp: int = 1
    """Virtual pipeline chunks per stage (`parallel.vpp`); 1 means no interleaving."""
    first_stage_layers: int = 0
    """Layers of the first stage (`parallel.first_stage_layers`); 0 = `stage_layer_counts`' rule."""
    last_stage_layers: int = 0
    """Layers of the last stage (`parallel.last_stage_layers`); 0 = `stage_layer_counts`' rule."""

    def __post_init__(self) -> None:
        check_positive("parallel.tp", self.tp)
        check_positive("parallel.pp", self.pp)
        check_positive("dp (world size / (parallel.tp * parallel.pp))", self.dp)
        check_positive("parallel.vpp", self.vpp)
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(
                f"parallel.vpp={self.vpp} needs parallel.pp > 1 (the interleaved schedule splits stages); "
                "set parallel.vpp=1 or parallel.pp >= 2"
            )
        check_stage_layer_keys(self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers)

    @classmethod
    def from_world_size(cls, world_size: int, tp: int, pp: int, vpp: int = 1) -> TrainLayout:
        """The layout with dp = world_size / (tp * pp), or a ValueError naming the keys."""
        check_positive("parallel.tp", tp)
        check_positive("parallel.pp", pp)
        if world_size % (tp * pp) != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {tp}*{pp}; "
                f"choose parallel.tp * parallel.pp in {divisors(world_size)}"
            )
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), vpp=vpp)

    @property
    def world_size(self) -> int:
        """Number of ranks N = tp * pp * dp."""
        return self.tp * self.pp * self.dp

    def rank(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        """Global rank of the given coordinates."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> TrainCoords:
        """Training coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        return TrainCoords(
            tp_rank=rank % self.tp, pp_rank=rank // (self.tp * self.dp), dp_rank=(rank // self.tp) % self.dp
        )

    def tp_groups(self) -> list[list[int]]:
        """TP groups, each ordered by tp_rank; equal to megatron's RankGenerator.get_ranks("tp")."""
        return self._groups(lambda c: (c.pp_rank, c.dp_rank), lambda c: c.tp_rank)

    def pp_groups(self) -> list[list[int]]:
        """PP groups, each ordered by pp_rank; equal to megatron's RankGenerator.get_ranks("pp")."""
        return self._groups(lambda c: (c.tp_rank, c.dp_rank), lambda c: c.pp_rank)

    def dp_groups(self) -> list[list[int]]:
        """DP groups, each ordered by dp_rank; equal to megatron's RankGenerator.get_ranks("dp")."""
        return self._groups(lambda c: (c.tp_rank, c.pp_rank), lambda c: c.dp_rank)

    def _groups(
        self, key: Callable[[TrainCoords], tuple], order: Callable[[TrainCoords], int]
    ) -> list[list[int]]:
        return group_by(self.world_size, lambda r: key(self.coords(r)), lambda r: order(self.coords(r)))

    def stage_layer_counts(self, num_layers: int) -> tuple[int, ...]:
        """Layers of each stage (see `parallel.stage_layers.stage_layer_counts`)."""
        return stage_layer_counts(
            num_layers, self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers
        )

    def layers(self, pp_rank: int, num_layers: int) -> list[range]:
        """Global layer indices held by stage `pp_rank`, one range per virtual chunk (megatron's order)."""
        return chunk_layers(self.stage_layer_counts(num_layers), self.vpp, pp_rank)

    def stage_of_layer(self, layer: int, num_layers: int) -> int:
        """The training stage (pp_rank) that holds global layer index `layer`."""
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer} is outside 0..{num_layers - 1}")
        counts = self.stage_layer_counts(num_layers)
        position = layer % (num_layers // self.vpp)  # index inside its row of virtual chunks
        for stage, count in enumerate(counts):
            position -= count // self.vpp
            if position < 0:
                return stage
        raise AssertionError("unreachable: the stage counts add up to num_layers")
