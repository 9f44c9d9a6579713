"""The plan of one 3D-HybridEngine transition: which bytes each member of a micro-DP group sends to which
peer, where they land on the receiver, and how every rollout tensor is assembled from the pieces.

Pure: computed from the group's parameter metadata (names, shapes, dtypes) and `HybridLayout`; this module
allocates no tensors and must not touch torch.distributed. `parallel/hybrid_engine.py` executes the plan.

Buffers (bytes, one flat allocation each, parameters are views into them):
- the member's training buffer T: every training parameter of the rank, ordered by how far it travels:
  [sent to every peer | sent only to peers at other training stages | not sent];
- per round, the receive buffer G_r: the messages of the peers, in position order;
- when t_g < t, the regroup buffer B: the rollout tensors that are assembled from several TP pieces.

What is sent (every byte once, from one source):
- TP-sharded tensors (QKV, proj, fc1, fc2, embedding, output layer): every peer needs every piece, either to
  widen its own rollout shard (same training stage) or to hold that stage's layers (other stages);
- replicated tensors (norms, QK-norms): only peers at other training stages need them, and only the member
  with tp offset 0 sends them (its same-stage peers hold identical copies);
- tied embeddings with PP > 1: the last stage's `output_layer.weight` is a copy of the embedding. It is
  sent, renamed `embedding.word_embeddings.weight`, only to a rollout stage that does not contain training
  stage 0 (rollout.pp > 1); otherwise the embedding of stage 0 is the one source and the copy stays home.
So a rank receives exactly its rollout shard minus what it holds: (t*p - t_g*p_g)/(t_g*p_g*t*p) * M for the
TP-sharded tensors, and (q-1)/p of the replicated layer tensors, q = p/p_g (`HybridLayout.received_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from parallel.hybrid_layout import HybridLayout, SliceBlock
from parallel.layout import PartitionKind
from parallel.rollout_weights import partition_kind, split_layer_name

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"


@dataclass(frozen=True)
class ParamMeta:
    """One training parameter of a member, by global name."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class MemberMeta:
    """A member of the micro-DP group and its parameters in `named_parameters` order."""

    position: int
    """Rank inside the micro-DP group (0..m-1), ascending with the global rank."""
    rank: int
    """Global rank."""
    params: tuple[ParamMeta, ...]


class Reach(str, Enum):
    """Which peers receive a tensor of the training buffer."""

    ALL = "all"
    OTHER_STAGES = "other_stages"
    NONE = "none"


@dataclass(frozen=True)
class Slot:
    """A tensor inside a flat byte buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    """Byte offset, aligned to `TransitionPlan.alignment`."""

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class SendLayout:
    """A member's training buffer T."""

    slots: tuple[Slot, ...]
    """Every parameter of the member, ALL first, then OTHER_STAGES, then NONE."""
    all_bytes: int
    """T[:all_bytes] goes to every peer."""
    send_bytes: int
    """T[:send_bytes] goes to the peers at other training stages."""
    total_bytes: int
    """Size of T."""


@dataclass(frozen=True)
class Message:
    """Bytes `src_range` of member `src`'s T land at `dst_offset` of member `dst`'s receive buffer `round`."""

    src: int
    dst: int
    round: int
    src_range: range
    dst_offset: int


@dataclass(frozen=True)
class Piece:
    """Part of a rollout tensor held by one member: copy `source[src]` into `rollout[dst]` along `dim` for
    each block (`SliceBlock.full` indexes the full tensor)."""

    position: int
    name: str
    """The parameter's name on that member (differs from the rollout name for a tied output layer copy)."""
    dim: int
    blocks: tuple[SliceBlock, ...]


@dataclass(frozen=True)
class RolloutTensor:
    """One tensor of this rank's rollout shard and how it is assembled."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: PartitionKind
    pieces: tuple[Piece, ...]
    round: int
    """Round in which its remote pieces arrive; -1 when it is this rank's own training tensor."""
    regroup_offset: int | None
    """Byte offset in the regroup buffer B when assembled by copy; None when it is a view (own training
    tensor, or one remote piece left in the receive buffer)."""

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TransitionPlan:
    """Everything this rank needs to run a transition; identical message lists on every member."""

    position: int
    """This rank's position in its micro-DP group."""
    members: tuple[MemberMeta, ...]
    send: tuple[SendLayout, ...]
    """Training-buffer layout of every member, by position."""
    num_rounds: int
    """Batched exchanges per transition (1 unless buckets are needed for regrouping)."""
    incoming: tuple[tuple[Message, ...], ...]
    """Per round, the messages to this rank, in position order of the sender."""
    outgoing: tuple[tuple[Message, ...], ...]
    """Per round, the messages from this rank."""
    recv_bytes: tuple[int, ...]
    """Per round, the size of the receive buffer G_r (messages plus alignment gaps)."""
    tensors: tuple[RolloutTensor, ...]
    """This rank's rollout shard, embedding first, then layers by global index, then the rest."""
    regroup: bool
    """True when t_g < t: rollout tensors are assembled from several TP pieces by a local copy."""
    regroup_bytes: int
    """Size of the regroup buffer B."""
    alignment: int
    """Byte alignment of every slot (the largest element size), so no padding with one dtype."""
    received_by_category: dict[str, int]
    """Payload bytes this rank receives: `layer_sharded`, `layer_replicated`, `non_layer`."""


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _align(x: int, alignment: int) -> int:
    return -(-x // alignment) * alignment


def _sort_key(name: str) -> tuple:
    if name == EMBEDDING:
        return (0, 0, name)
    parts = split_layer_name(name)
    if parts is not None:
        return (1, parts[0], parts[1])
    return (2, 0, name)


def _category(name: str, kind: PartitionKind) -> str:
    if split_layer_name(name) is None:
        return "non_layer"
    return "layer_replicated" if kind == PartitionKind.REPLICATED else "layer_sharded"


class _Group:
    """The micro-DP group seen from the layout: stages, tp offsets, which names it holds."""

    def __init__(self, layout: HybridLayout, members: list[MemberMeta], tie_embeddings: bool):
        self.layout, self.members, self.tie = layout, members, tie_embeddings
        k = layout.tp_ratio
        coords = [layout.train.coords(m.rank) for m in members]
        self.stage = [c.pp_rank for c in coords]
        self.tp_offset = [c.tp_rank % k for c in coords]
        self.has_embedding = any(p.name == EMBEDDING for m in members for p in m.params)

    def rollout_name(self, name: str) -> str | None:
        """The name a parameter takes in the rollout shard, or None when no rollout tensor comes from it."""
        if self.tie and name == OUTPUT_LAYER:
            return None if self.has_embedding else EMBEDDING
        return name

    def reach(self, position: int, param: ParamMeta) -> Reach:
        if len(self.members) == 1 or self.rollout_name(param.name) is None:
            return Reach.NONE
        if partition_kind(param.name) != PartitionKind.REPLICATED:
            return Reach.ALL
        if self.layout.pp_ratio > 1 and self.tp_offset[position] == 0:
            return Reach.OTHER_STAGES
        return Reach.NONE


def _send_layout(group: _Group, position: int, alignment: int) -> SendLayout:
    member = group.members[position]
    by_reach: dict[Reach, list[ParamMeta]] = {r: [] for r in Reach}
    for p in member.params:
        by_reach[group.reach(position, p)].append(p)
    slots, offset, ends = [], 0, {}
    for reach in (Reach.ALL, Reach.OTHER_STAGES, Reach.NONE):
        for p in by_reach[reach]:
            offset = _align(offset, alignment)
            slots.append(Slot(p.name, p.shape, p.dtype, offset))
            offset += p.nbytes
        ends[reach] = offset
    return SendLayout(tuple(slots), ends[Reach.ALL], ends[Reach.OTHER_STAGES], offset)


def _round_of(slot: Slot, bucket_bytes: int | None) -> int:
    return 0 if bucket_bytes is None else slot.offset // bucket_bytes


def _messages(
    group: _Group, send: list[SendLayout], bucket_bytes: int | None, alignment: int
) -> tuple[list[Message], int]:
    """All messages of the group (every member derives the same list) and the number of rounds."""
    num_rounds = 1 + max(
        (_round_of(s, bucket_bytes) for lay in send for s in lay.slots if s.offset < lay.send_bytes),
        default=0,
    )
    messages, m = [], len(group.members)
    for dst in range(m):
        for r in range(num_rounds):
            cursor = 0
            for src in range(m):
                if src == dst:
                    continue
                limit = send[src].all_bytes if group.stage[src] == group.stage[dst] else send[src].send_bytes
                chosen = [s for s in send[src].slots if s.end <= limit and _round_of(s, bucket_bytes) == r]
                if not chosen:
                    continue
                cursor = _align(cursor, alignment)
                rng = range(chosen[0].offset, chosen[-1].end)
                messages.append(Message(src, dst, r, rng, cursor))
                cursor += len(rng)
    return messages, num_rounds


def _pieces(group: _Group, position: int, target: str, holders: list[tuple[int, ParamMeta]]) -> list[Piece]:
    layout = group.layout
    source = holders[0][1]
    kind = partition_kind(source.name)
    if kind == PartitionKind.REPLICATED:
        mine = [h for h in holders if h[0] == position]
        pos, meta = mine[0] if mine else next(h for h in holders if group.tp_offset[h[0]] == 0)
        whole = range(meta.shape[0])
        return [Piece(pos, meta.name, 0, (SliceBlock(whole, whole, whole),))]
    if len(holders) != layout.tp_ratio or len({group.stage[h[0]] for h in holders}) != 1:
        raise RuntimeError(
            f"{target}: expected {layout.tp_ratio} TP pieces from one training stage in the micro-DP group, "
            f"got positions {[h[0] for h in holders]}; the model chunks do not match the layout"
        )
    dim = 1 if kind == PartitionKind.ROW else 0
    pieces = []
    for pos, meta in holders:
        placement = layout.placement(group.members[pos].rank, kind, meta.shape[dim] * layout.train.tp)
        pieces.append(Piece(pos, meta.name, dim, placement.blocks))
    return pieces


def plan_transition(
    layout: HybridLayout,
    members: list[MemberMeta],
    position: int,
    tie_embeddings: bool,
    bucket_bytes: int | None = None,
) -> TransitionPlan:
    """The plan for the member at `position` of a micro-DP group (`members` ordered by position).

    `bucket_bytes` splits the exchange into rounds of about that many bytes per sender, so that the receive
    buffers of a regrouping transition (t_g < t) are staged a bucket at a time; it is ignored when nothing
    is regrouped, because then the receive buffers are the rollout storage itself.
    """
    group = _Group(layout, members, tie_embeddings)
    regroup = layout.tp_ratio > 1
    buckets = bucket_bytes if regroup else None
    if buckets is not None and buckets < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be a positive number of bytes or None")
    alignment = max((p.dtype.itemsize for m in members for p in m.params), default=1)
    send = [_send_layout(group, i, alignment) for i in range(len(members))]
    messages, num_rounds = _messages(group, send, buckets, alignment)
    incoming = [
        [msg for msg in messages if msg.dst == position and msg.round == r] for r in range(num_rounds)
    ]
    outgoing = [
        [msg for msg in messages if msg.src == position and msg.round == r] for r in range(num_rounds)
    ]
    recv_bytes = [max((msg.dst_offset + len(msg.src_range) for msg in inc), default=0) for inc in incoming]

    arrival = {}  # (src position, name) -> round, for everything this rank receives
    received = {"layer_sharded": 0, "layer_replicated": 0, "non_layer": 0}
    for inc in incoming:
        for msg in inc:
            for s in send[msg.src].slots:
                if s.offset >= msg.src_range.start and s.end <= msg.src_range.stop:
                    arrival[(msg.src, s.name)] = msg.round
                    received[_category(s.name, partition_kind(s.name))] += s.nbytes

    holders: dict[str, list[tuple[int, ParamMeta]]] = {}
    for m in members:
        for p in m.params:
            target = group.rollout_name(p.name)
            if target is not None:
                holders.setdefault(target, []).append((m.position, p))
    tensors, regroup_cursor = [], 0
    for target in sorted(holders, key=_sort_key):
        pieces = _pieces(group, position, target, holders[target])
        source = holders[target][0][1]
        kind = partition_kind(source.name)
        shape = list(source.shape)
        if kind != PartitionKind.REPLICATED:
            shape[pieces[0].dim] *= layout.tp_ratio
        remote_rounds = {arrival[(pc.position, pc.name)] for pc in pieces if pc.position != position}
        if len(remote_rounds) > 1:
            raise RuntimeError(f"{target}: pieces arrive in different rounds {remote_rounds}")  # plan bug
        offset = None
        if remote_rounds and (regroup or len(pieces) > 1):
            regroup_cursor = _align(regroup_cursor, alignment)
            offset = regroup_cursor
            regroup_cursor += _numel(tuple(shape)) * source.dtype.itemsize
        tensors.append(
            RolloutTensor(
                target,
                tuple(shape),
                source.dtype,
                kind,
                tuple(pieces),
                remote_rounds.pop() if remote_rounds else -1,
                offset,
            )
        )
    return TransitionPlan(
        position=position,
        members=tuple(members),
        send=tuple(send),
        num_rounds=num_rounds,
        incoming=tuple(tuple(x) for x in incoming),
        outgoing=tuple(tuple(x) for x in outgoing),
        recv_bytes=tuple(recv_bytes),
        tensors=tuple(tensors),
        regroup=regroup,
        regroup_bytes=regroup_cursor,
        alignment=alignment,
        received_by_category=received,
    )
