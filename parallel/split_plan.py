"""Rank math of the weight transfer between disjoint training and rollout ranks (split placement).

Pure integers and ranges: no torch, no process groups (`parallel/split_transfer.py` moves the bytes).

Ranks [0, n) train with megatron's layout (t, p, d); with `placement.critic_ranks` = C, ranks [n, n + C) train
PPO's critic with a layout of its own (the same DP size d); ranks [n + C, n + C + K) generate with their own layout of
t_g-way TP and K / t_g replicas (rollout rank n + C + e * t_g + j has rollout TP rank j in replica e, no rollout PP).
Every rollout rank needs its rollout-TP shard of every tensor of the model. Replica e reads from training
replica e % d, so the training replicas share the sending. Each training TP shard and each rollout TP shard
is a union of contiguous index ranges of the full tensor along the partition dim (one range; two for the
SwiGLU fc1 stored as [gate_i; up_i]; megatron's QKV is interleaved per query group, so its shards are
contiguous too), so what training rank (a, s, e % d) sends to rollout rank (j, e) is the intersection of
the two shards: exact bytes, no full tensor anywhere, for any t and t_g that divide the sizes. Replicated
tensors (norms) come from the training TP rank j % t.

The blocks between one sender and one receiver are cut into buckets of at most `bucket_bytes` (a block
larger than that is split along its partition dim), one message per bucket; round r moves every pair's
r-th bucket, so a receiver stages at most (senders x bucket_bytes) at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from parallel.layout import PartitionKind, TrainLayout


@dataclass(frozen=True)
class SplitLayout:
    """Training ranks [0, train.world_size), the critic's ranks (if any) after them, then the rollout ranks."""

    train: TrainLayout
    """Layout of the training ranks."""
    rollout_tp: int
    """Rollout TP size t_g (`rollout.tp`)."""
    rollout_ranks: int
    """Number of rollout ranks K (`placement.rollout_ranks`)."""
    critic: TrainLayout | None = None
    """Layout of the critic's own ranks (`placement.critic_ranks`), None when the critic (if any) shares the
    actor's ranks. Its DP size is the actor's: critic replica d serves training replica d."""

    def __post_init__(self) -> None:
        if self.rollout_ranks < 1 or self.rollout_tp < 1 or self.rollout_ranks % self.rollout_tp:
            raise ValueError(
                f"rollout.tp={self.rollout_tp} must divide placement.rollout_ranks={self.rollout_ranks}"
            )

    @property
    def num_train_ranks(self) -> int:
        return self.train.world_size

    @property
    def num_critic_ranks(self) -> int:
        return self.critic.world_size if self.critic is not None else 0

    @property
    def rollout_start(self) -> int:
        """The first rollout rank."""
        return self.num_train_ranks + self.num_critic_ranks

    @property
    def world_size(self) -> int:
        return self.rollout_start + self.rollout_ranks

    def is_critic_rank(self, rank: int) -> bool:
        return self.num_train_ranks <= rank < self.rollout_start

    def describe_rank(self, rank: int) -> str:
        """A rank's side and coordinates, for failure messages: 'training rank 1 at TP 0, PP 0, DP 1', 'critic
        rank 2 at TP 0, PP 0, DP 0' (the critic's own layout), 'rollout rank 3 at rollout TP 0, DP 0'."""
        if self.is_rollout_rank(rank):
            tp_rank, dp_rank = self.rollout_coords(rank)
            return f"rollout rank {rank} at rollout TP {tp_rank}, DP {dp_rank}"
        if self.is_critic_rank(rank):
            side, at = "critic", self.critic.coords(rank - self.num_train_ranks)
        else:
            side, at = "training", self.train.coords(rank)
        return f"{side} rank {rank} at TP {at.tp_rank}, PP {at.pp_rank}, DP {at.dp_rank}"

    def critic_replica_ranks(self, train_dp_rank: int) -> list[int]:
        """The critic's ranks (tp x pp) serving training replica `train_dp_rank` (critic replica of that index)."""
        n = self.num_train_ranks
        return [n + r for r in range(self.num_critic_ranks) if self.critic.coords(r).dp_rank == train_dp_rank]

    @property
    def rollout_dp(self) -> int:
        """Number of rollout replicas."""
        return self.rollout_ranks // self.rollout_tp

    def is_rollout_rank(self, rank: int) -> bool:
        return rank >= self.rollout_start

    def rollout_rank(self, dp_rank: int, tp_rank: int) -> int:
        return self.rollout_start + dp_rank * self.rollout_tp + tp_rank

    def rollout_coords(self, rank: int) -> tuple[int, int]:
        """(rollout tp_rank, rollout dp_rank) of a rollout rank."""
        local = rank - self.rollout_start
        if not 0 <= local < self.rollout_ranks:
            raise ValueError(f"rank {rank} is not a rollout rank")
        return local % self.rollout_tp, local // self.rollout_tp

    def rollout_tp_groups(self) -> list[list[int]]:
        return [[self.rollout_rank(e, j) for j in range(self.rollout_tp)] for e in range(self.rollout_dp)]

    def source_replica(self, rollout_dp_rank: int) -> int:
        """The training DP replica that sends to rollout replica `rollout_dp_rank`."""
        return rollout_dp_rank % self.train.dp

    def assignments(self, rollout_dp_rank: int) -> list[tuple[int, int, int]]:
        """What rollout replica `rollout_dp_rank` generates each step: (training replica d, share, shares) for
        each prompt share it owns. With at most as many rollout as training replicas, it serves the whole
        batches of the replicas d with d mod rollout DP == e (share 0 of 1); with more, the replicas e with
        e mod d_train == d split replica d's prompts in shares, in order of e (as colocated placement's
        micro-DP group does)."""
        e, dp = rollout_dp_rank, self.train.dp
        if self.rollout_dp <= dp:
            return [(d, 0, 1) for d in range(e, dp, self.rollout_dp)]
        peers = list(range(e % dp, self.rollout_dp, dp))
        return [(e % dp, peers.index(e), len(peers))]

    def serving_ranks(self, train_dp_rank: int) -> list[int]:
        """The rollout ranks that send training replica `train_dp_rank` its responses, in share order: rollout
        TP rank 0 of each serving replica (every rank of a rollout replica holds the same responses)."""
        d, dp = train_dp_rank, self.train.dp
        replicas = [d % self.rollout_dp] if self.rollout_dp <= dp else list(range(d, self.rollout_dp, dp))
        return [self.rollout_rank(e, 0) for e in replicas]

    def replica_ranks(self, train_dp_rank: int) -> list[int]:
        """The training ranks (tp x pp) of training replica `train_dp_rank`."""
        return [r for r in range(self.num_train_ranks) if self.train.coords(r).dp_rank == train_dp_rank]


@dataclass(frozen=True)
class TensorMeta:
    """A full (unsharded) tensor of the model, and where it lives in training."""

    name: str
    """Global name (`parallel/rollout_weights.py`)."""
    kind: PartitionKind
    """How megatron splits it over TP ranks."""
    full_shape: tuple[int, ...]
    """Shape of the whole tensor."""
    itemsize: int
    """Bytes per element."""
    stage: int
    """Training pipeline stage that holds it."""

    @property
    def dim(self) -> int:
        """The partition dim (0 for replicated tensors, which are sent whole)."""
        return 1 if self.kind == PartitionKind.ROW else 0

    @property
    def unit_bytes(self) -> int:
        """Bytes of one index along `dim`."""
        return prod(self.full_shape) // self.full_shape[self.dim] * self.itemsize

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        shape = list(self.full_shape)
        if self.kind != PartitionKind.REPLICATED:
            shape[self.dim] //= tp
        return tuple(shape)


@dataclass(frozen=True)
class Block:
    """A run of indices along `dim` copied from a training shard into a rollout shard."""

    name: str
    src: range
    """Indices inside the sender's training shard."""
    dst: range
    """Indices inside the receiver's rollout shard."""
    offset: int
    """Byte offset inside the bucket (the block is packed contiguous, as `narrow(dim, ...)` of the shard)."""
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """One message: blocks from training rank `src` to rollout rank `dst` in round `round`."""

    src: int
    dst: int
    round: int
    blocks: tuple[Block, ...]
    nbytes: int


def shard_ranges(kind: PartitionKind, full_size: int, tp: int, tp_rank: int) -> list[range]:
    """The full-tensor index ranges (along the partition dim) that TP shard `tp_rank` of `tp` holds, in the
    order the shard stores them."""
    if kind == PartitionKind.REPLICATED or tp == 1:
        return [range(full_size)]
    if kind == PartitionKind.COLUMN_GATED:
        half, part = full_size // 2, full_size // 2 // tp
        return [range(h + tp_rank * part, h + (tp_rank + 1) * part) for h in (0, half)]
    part = full_size // tp
    return [range(tp_rank * part, (tp_rank + 1) * part)]


def _intersect(src: list[range], dst: list[range]) -> list[tuple[range, range]]:
    """(indices in the src shard, indices in the dst shard) of every overlap of two shards' full ranges."""
    out = []
    src_at = 0
    for a in src:
        dst_at = 0
        for b in dst:
            lo, hi = max(a.start, b.start), min(a.stop, b.stop)
            if lo < hi:
                out.append(
                    (
                        range(src_at + lo - a.start, src_at + hi - a.start),
                        range(dst_at + lo - b.start, dst_at + hi - b.start),
                    )
                )
            dst_at += len(b)
        src_at += len(a)
    return out


def check_divisible(tensors: list[TensorMeta], tp_sizes: tuple[int, ...]) -> None:
    """ValueError naming the tensor unless every TP size splits it (the gated fc1 per half)."""
    for t in tensors:
        if t.kind == PartitionKind.REPLICATED:
            continue
        size = t.full_shape[t.dim] // (2 if t.kind == PartitionKind.COLUMN_GATED else 1)
        for tp in tp_sizes:
            if size % tp:
                raise ValueError(f"{t.name}: size {size} along dim {t.dim} is not divisible by TP size {tp}")


def plan_split_transfer(layout: SplitLayout, tensors: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Every message of one training -> rollout transfer (the same list on every rank)."""
    train, tg = layout.train, layout.rollout_tp
    check_divisible(tensors, (train.tp, tg))
    pairs: dict[tuple[int, int], list[tuple[str, range, range, int]]] = {}
    for dst in range(layout.rollout_start, layout.world_size):
        j, e = layout.rollout_coords(dst)
        replica = layout.source_replica(e)
        for t in tensors:
            full = t.full_shape[t.dim]
            want = shard_ranges(t.kind, full, tg, j)
            sources = [j % train.tp] if t.kind == PartitionKind.REPLICATED else range(train.tp)
            for a in sources:
                src = train.rank(a, t.stage, replica)
                for s, d in _intersect(shard_ranges(t.kind, full, train.tp, a), want):
                    pairs.setdefault((src, dst), []).append((t.name, s, d, t.unit_bytes))
    buckets = []
    for (src, dst), runs in pairs.items():
        buckets += _bucketize(src, dst, runs, bucket_bytes)
    return buckets


def _bucketize(src: int, dst: int, runs: list, bucket_bytes: int) -> list[Bucket]:
    out, blocks, used = [], [], 0

    def close():
        nonlocal blocks, used
        if blocks:
            out.append(Bucket(src, dst, len(out), tuple(blocks), used))
        blocks, used = [], 0

    for name, s, d, unit in runs:
        start = 0
        while start < len(s):
            room = max((bucket_bytes - used) // unit, 0)
            if room == 0 and blocks:
                close()
                continue
            n = min(len(s) - start, max(room, 1))
            blocks.append(Block(name, s[start : start + n], d[start : start + n], used, n * unit))
            used += n * unit
            start += n
    close()
    return out


def received_bytes(buckets: list[Bucket], rank: int) -> int:
    return sum(b.nbytes for b in buckets if b.dst == rank)


def rollout_shard_bytes(tensors: list[TensorMeta], tp: int) -> int:
    """Bytes of one rollout rank's shard of the model."""
    return sum(prod(t.shard_shape(tp)) * t.itemsize for t in tensors)
