"""Rank math of the 3D-HybridEngine: the rollout layout next to a training layout, its groups, layer and
slice ownership, and the bytes each rank holds and receives.

Pure integers and ranges. This module must not import torch or torch.distributed, nor create process
groups: `parallel/state.py` turns the group lists into process groups and `parallel/hybrid_engine.py`
moves tensors with the ranges computed here. The training layout is `parallel/layout.py`.

Rollout layout (t_g, p_g), after HybridFlow (arXiv 2409.19256) sec. 5. With k = t / t_g and q = p / p_g,
inside one training DP replica the rollout shard (j, s) is made of training TP shards [j*k, (j+1)*k) of
training stages [s*q, (s+1)*q). The m = k*q training ranks holding those pieces form a micro-DP group,
ordered by (pp_rank, tp_rank); a member's position `(pp_rank % q) * k + tp_rank % k` says which layers
(stage offset) and which sub-slice (TP offset) it contributes. One all-gather inside the micro-DP group
builds the rollout shard, and every rank's training shard is a sub-slice of its rollout shard.

Where this departs from the paper, and why:
- the paper's "d_g" is our micro-DP size m; our rollout DP size is d * m, the number of rollout replicas;
  a rank's rollout DP index is `dp_rank * m + position`;
- ranks keep megatron's order and groups are defined by coordinates rather than by rank strides; the
  paper's example (t=4, p=1, d=2, t_g=2) comes out identical;
- the SwiGLU fc1 is stored per TP shard as [gate_i; up_i], so a wider shard is a regrouping of the
  narrower ones, not their concatenation: `column_gated` placements have two blocks;
- with vpp > 1, rollout stage s holds training stages [s*q, (s+1)*q), one contiguous range per virtual
  chunk (`rollout_layers`); with even stages that is megatron's interleaved assignment at (p_g, vpp).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from parallel.layout import PartitionKind, TrainLayout, check_positive, divisors, group_by


@dataclass(frozen=True)
class RolloutLayout:
    """Rollout model-parallel sizes; the rollout DP size follows from the training layout."""

    tp: int
    """Rollout tensor-parallel size t_g (`rollout.tp`); must divide parallel.tp."""
    pp: int = 1
    """Rollout pipeline-parallel size p_g (`rollout.pp`); must divide parallel.pp."""

    def __post_init__(self) -> None:
        check_positive("rollout.tp", self.tp)
        check_positive("rollout.pp", self.pp)


def validate_rollout(train: TrainLayout, rollout: RolloutLayout) -> None:
    """Raise ValueError unless rollout.tp divides parallel.tp and rollout.pp divides parallel.pp."""
    for axis, train_size, rollout_size in (("tp", train.tp, rollout.tp), ("pp", train.pp, rollout.pp)):
        if train_size % rollout_size != 0:
            raise ValueError(
                f"rollout.{axis}={rollout_size} must divide parallel.{axis}={train_size} (each rollout shard "
                f"must be a union of training shards); try rollout.{axis} in {set(divisors(train_size))}"
            )


@dataclass(frozen=True)
class RolloutCoords:
    """Where a rank sits in the rollout layout."""

    tp_rank: int
    """Rollout TP rank j, 0..t_g-1: holds training TP shards [j*k, (j+1)*k) regrouped."""
    pp_rank: int
    """Rollout stage s, 0..p_g-1: holds the layers of training stages [s*q, (s+1)*q)."""
    dp_rank: int
    """Rollout replica index, training dp_rank * m + micro_dp_rank, 0..d*m-1."""
    micro_dp_rank: int
    """Position in the micro-DP group, (pp_rank % q) * k + tp_rank % k (training coordinates)."""


@dataclass(frozen=True)
class SliceBlock:
    """A contiguous run of a training shard and where it lands; all ranges index `Placement.dim`."""

    src: range
    """Indices inside the rank's training shard."""
    dst: range
    """Indices inside the rollout shard (same length as `src`)."""
    full: range
    """Indices inside the full, unsharded tensor."""


@dataclass(frozen=True)
class Placement:
    """What one rank's training shard contributes to its micro-DP group's rollout shard of one parameter."""

    kind: PartitionKind
    """Partition kind of the parameter."""
    dim: int
    """Tensor dim the ranges index: 0 for column/column_gated/replicated, 1 for row."""
    train_size: int
    """Size along `dim` of the training shard."""
    rollout_size: int
    """Size along `dim` of the rollout shard: allocate the rollout buffer with it."""
    blocks: tuple[SliceBlock, ...]
    """Copy `train[src]` into `rollout[dst]` for each block. Empty for a replicated parameter on a member
    with tp offset > 0: the tp offset 0 member at the same stage is the source of that tensor."""


@dataclass(frozen=True)
class ParamSpec:
    """A parameter for communication and memory accounting."""

    num_bytes: int
    """Bytes of the full, unsharded tensor."""
    kind: PartitionKind
    """How it is split over TP ranks."""
    pp_rank: int
    """Training stage that holds it (`TrainLayout.stage_of_layer` for layer parameters)."""


@dataclass(frozen=True)
class HybridLayout:
    """A training layout and a compatible rollout layout: rollout groups, ownership and slice placements."""

    train: TrainLayout
    """Training layout (t, p, d, vpp)."""
    rollout: RolloutLayout
    """Rollout layout (t_g, p_g); validated against `train` on construction."""

    def __post_init__(self) -> None:
        validate_rollout(self.train, self.rollout)

    @property
    def tp_ratio(self) -> int:
        """k = t / t_g: training TP shards per rollout TP shard."""
        return self.train.tp // self.rollout.tp

    @property
    def pp_ratio(self) -> int:
        """q = p / p_g: training stages per rollout stage."""
        return self.train.pp // self.rollout.pp

    @property
    def micro_dp_size(self) -> int:
        """m = (t * p) / (t_g * p_g): ranks that all-gather one rollout shard."""
        return self.tp_ratio * self.pp_ratio

    @property
    def rollout_dp_size(self) -> int:
        """d_g = N / (t_g * p_g): number of rollout replicas."""
        return self.train.dp * self.micro_dp_size

    def rollout_coords(self, rank: int) -> RolloutCoords:
        """Rollout coordinates of a global rank."""
        c = self.train.coords(rank)
        k, q = self.tp_ratio, self.pp_ratio
        position = (c.pp_rank % q) * k + c.tp_rank % k
        return RolloutCoords(
            tp_rank=c.tp_rank // k,
            pp_rank=c.pp_rank // q,
            dp_rank=c.dp_rank * self.micro_dp_size + position,
            micro_dp_rank=position,
        )

    def _groups(
        self, key: Callable[[RolloutCoords], tuple], order: Callable[[RolloutCoords], int]
    ) -> list[list[int]]:
        return group_by(
            self.train.world_size,
            lambda r: key(self.rollout_coords(r)),
            lambda r: order(self.rollout_coords(r)),
        )

    def rollout_tp_groups(self) -> list[list[int]]:
        """Rollout TP groups (size t_g, ranks at stride k), each ordered by rollout tp_rank."""
        return self._groups(lambda c: (c.pp_rank, c.dp_rank), lambda c: c.tp_rank)

    def rollout_pp_groups(self) -> list[list[int]]:
        """Rollout PP groups (size p_g), each ordered by rollout pp_rank."""
        return self._groups(lambda c: (c.tp_rank, c.dp_rank), lambda c: c.pp_rank)

    def rollout_dp_groups(self) -> list[list[int]]:
        """Rollout DP groups (size d*m), each ordered by rollout dp_rank, which is not always rank order
        (it is when p_g = p or d = 1): a process group's own ranks are sorted, so map explicitly."""
        return self._groups(lambda c: (c.tp_rank, c.pp_rank), lambda c: c.dp_rank)

    def micro_dp_groups(self) -> list[list[int]]:
        """Micro-DP groups (size m), ordered by position, i.e. by (pp_rank, tp_rank), i.e. ascending rank,
        so a process group's rank equals the position."""
        return self._groups(
            lambda c: (c.tp_rank, c.pp_rank, c.dp_rank // self.micro_dp_size), lambda c: c.micro_dp_rank
        )

    def rollout_layers(self, rank: int, num_layers: int) -> list[range]:
        """Layers held by `rank` in the rollout layout, one range per virtual chunk: the union of training
        stages [s*q, (s+1)*q), which is contiguous inside each virtual chunk."""
        q, s = self.pp_ratio, self.rollout_coords(rank).pp_rank
        first = self.train.layers(s * q, num_layers)
        last = self.train.layers((s + 1) * q - 1, num_layers)
        return [range(a.start, b.stop) for a, b in zip(first, last)]

    def stage_positions(self, train_pp_rank: int) -> range:
        """Micro-DP positions of the members at training stage `train_pp_rank`; the i-th of them has tp offset
        i, i.e. contributes sub-slice i. Use it for embedding (stage 0) and output layer (last stage)."""
        offset = (train_pp_rank % self.pp_ratio) * self.tp_ratio
        return range(offset, offset + self.tp_ratio)

    def owner_positions(self, rank: int, layer: int, num_layers: int) -> range:
        """Micro-DP positions of the members of `rank`'s group that hold `layer` in training (see
        `stage_positions`); ValueError if `rank` does not hold `layer` in the rollout layout."""
        stage = self.train.stage_of_layer(layer, num_layers)
        if stage // self.pp_ratio != self.rollout_coords(rank).pp_rank:
            raise ValueError(f"rank {rank} does not hold layer {layer} in the rollout layout")
        return self.stage_positions(stage)

    def placement(self, rank: int, kind: PartitionKind | str, full_size: int) -> Placement:
        """Where `rank`'s training shard of a parameter goes inside the rollout shard of its micro-DP group.

        `full_size` is the size of the full tensor along the partition dim (dim 1 for row, else dim 0; for
        column_gated it is 2 * ffn_hidden, the full tensor being [gate; up]). Training shard i holds
        full[i*n/t, (i+1)*n/t) (column_gated: gate and up rows of that range); rollout shard j likewise at
        width t_g. The blocks of the members at one stage tile the rollout shard exactly. QKV is `column`
        because megatron interleaves it per query group; that needs num_query_groups % parallel.tp == 0.

        Use: allocate the rollout buffer with `rollout_size` along `dim`, copy the own shard's blocks, and
        fill the rest from the other members (`micro_dp_groups`, `stage_positions`) with their placements.
        """
        kind = PartitionKind(kind)
        t, k = self.train.tp, self.tp_ratio
        tp_rank = self.train.coords(rank).tp_rank
        offset = tp_rank % k
        if kind == PartitionKind.REPLICATED:
            whole = range(full_size)
            blocks = (SliceBlock(whole, whole, whole),) if offset == 0 else ()
            return Placement(kind, 0, full_size, full_size, blocks)
        num_halves = 2 if kind == PartitionKind.COLUMN_GATED else 1
        if full_size % (num_halves * t) != 0:
            raise ValueError(
                f"a {kind.value} parameter of size {full_size} along its partition dim is not divisible by "
                f"{num_halves}*parallel.tp = {num_halves * t}; pad it (vocab) or choose parallel.tp among its divisors"
            )
        half_full = full_size // num_halves  # rows of gate (or of the whole tensor when not gated)
        width = half_full // t  # one half of a training shard
        blocks = tuple(
            SliceBlock(
                src=range(h * width, (h + 1) * width),
                dst=range(h * k * width + offset * width, h * k * width + (offset + 1) * width),
                full=range(h * half_full + tp_rank * width, h * half_full + (tp_rank + 1) * width),
            )
            for h in range(num_halves)
        )
        dim = 1 if kind == PartitionKind.ROW else 0
        return Placement(kind, dim, num_halves * width, num_halves * k * width, blocks)

    def _shard_bytes(self, param: ParamSpec, tp: int) -> int:
        if param.kind == PartitionKind.REPLICATED:
            return param.num_bytes
        if param.num_bytes % self.train.tp != 0:
            raise ValueError(
                f"a {param.kind.value} parameter of {param.num_bytes} bytes does not split over "
                f"parallel.tp={self.train.tp}; give the full tensor's bytes (a multiple of the TP size)"
            )
        return param.num_bytes // tp

    def rollout_weight_bytes(self, rank: int, params: Iterable[ParamSpec]) -> int:
        """Bytes of weights `rank` holds in the rollout layout (peak weight memory, M/(t_g*p_g) when all
        parameters are sharded and spread evenly over the stages)."""
        s = self.rollout_coords(rank).pp_rank
        return sum(self._shard_bytes(p, self.rollout.tp) for p in params if p.pp_rank // self.pp_ratio == s)

    def received_bytes(self, rank: int, params: Iterable[ParamSpec]) -> int:
        """Bytes `rank` receives in the train -> rollout transition: its rollout shard minus what it already
        holds; equals (t*p - t_g*p_g) / (t_g*p_g*t*p) * M in HybridFlow's setting."""
        params = list(params)
        return self.rollout_weight_bytes(rank, params) - self._train_weight_bytes(rank, params)

    def naive_received_bytes(self, rank: int, params: Iterable[ParamSpec]) -> int:
        """Bytes `rank` receives when every rank gathers the full model (the baseline): M minus its shard."""
        params = list(params)
        return sum(p.num_bytes for p in params) - self._train_weight_bytes(rank, params)

    def _train_weight_bytes(self, rank: int, params: list[ParamSpec]) -> int:
        own_pp = self.train.coords(rank).pp_rank
        return sum(self._shard_bytes(p, self.train.tp) for p in params if p.pp_rank == own_pp)
