"""Split placement's weight transfer: the actor's training shards -> each rollout rank's rollout-layout shard,
between disjoint ranks (the rank math is `parallel/split_plan.py`).

Each rollout rank receives exactly the bytes of its shard, from the training ranks that hold them; no rank
builds a full tensor. Messages are buckets of at most `bucket_bytes` per (sender, receiver) pair, sent with
batched point-to-point operations (one NCCL group call per round on GPU, gloo on CPU). Rounds overlap: the
sender packs round r + 1 while round r is in flight, the receiver unpacks round r while round r + 1 arrives.
A bucket that is one contiguous block (a whole tensor, or a dim-0 slice) is sent from, or received into,
the tensor itself; others are packed into a staging buffer. The rollout ranks keep their shard between
transfers (allocated once, overwritten in place); the training parameters are only read.

The model is assumed to have one parameter dtype (`model.dtype`), so packed blocks stay aligned.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from parallel.rollout_weights import RolloutWeights, partition_kind
from parallel.split_plan import Block, Bucket, SplitLayout, TensorMeta, plan_split_transfer

DEFAULT_BUCKET_BYTES = 64 * 2**20


def tensor_metas(
    layout: SplitLayout, reported: list[tuple[int, list]], tie_embeddings: bool
) -> list[TensorMeta]:
    """The full tensors of the model from the training ranks' (rank, [(name, shard shape, dtype)]) reports:
    each taken from its first reporter; with tied embeddings the last stage's output layer copy is left out."""
    train = layout.train
    seen: dict[str, TensorMeta] = {}
    for rank, metas in reported:
        for name, shape, dtype in metas:
            if name in seen or (tie_embeddings and name == "output_layer.weight"):
                continue
            kind = partition_kind(name)
            full = list(shape)
            if kind.value != "replicated":
                full[1 if kind.value == "row" else 0] *= train.tp
            itemsize = torch.empty((), dtype=dtype).element_size()
            seen[name] = TensorMeta(name, kind, tuple(full), itemsize, train.coords(rank).pp_rank)
    return list(seen.values())


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class SplitTransfer:
    """Training -> rollout weight transfer for split placement; construct on every rank, in the same order.

    `local` is this training rank's parameters by global name (`global_param_names`), None on a rollout rank.
    The constructor gathers every training rank's parameter shapes over `world` (the group of all ranks),
    plans the messages and creates the rollout TP groups. Then call `send()` on the training ranks and
    `receive()` on the rollout ranks, each time the actor's weights change.
    """

    def __init__(
        self,
        layout: SplitLayout,
        rank: int,
        local: dict[str, torch.Tensor] | None,
        tie_embeddings: bool,
        device: torch.device,
        world: dist.ProcessGroup,
        timeout,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        self.layout, self.rank, self.device, self.world = layout, rank, device, world
        self.local = local or {}
        report = [(n, tuple(p.shape), p.dtype) for n, p in self.local.items()]
        reported: list = [None] * layout.world_size
        dist.all_gather_object(reported, (rank, report), group=world)
        self.tensors = {
            t.name: t for t in tensor_metas(layout, [r for r in reported if r[1]], tie_embeddings)
        }
        self.dtypes = {n: d for _, metas in reported for n, _, d in metas}
        buckets = plan_split_transfer(layout, list(self.tensors.values()), bucket_bytes)
        self.buckets = buckets
        """Every message of a transfer (the same list on every rank)."""
        self.num_rounds = 1 + max((b.round for b in buckets), default=-1)
        self.sends = self._by_round([b for b in buckets if b.src == rank])
        self.recvs = self._by_round([b for b in buckets if b.dst == rank])
        self.tp_group = None
        for ranks in layout.rollout_tp_groups():
            group = dist.new_group(ranks, timeout=timeout)
            self.tp_group = group if rank in ranks else self.tp_group
        self.params: dict[str, torch.Tensor] = {}
        if layout.is_rollout_rank(rank):
            tg = layout.rollout_tp
            self.params = {
                n: torch.empty(t.shard_shape(tg), dtype=self.dtypes[n], device=device)
                for n, t in self.tensors.items()
            }
        self.last_stats: dict[str, float] = {}

    def _by_round(self, buckets: list[Bucket]) -> list[list[Bucket]]:
        rounds: list[list[Bucket]] = [[] for _ in range(self.num_rounds)]
        for b in buckets:
            rounds[b.round].append(b)
        return rounds

    def _block_view(self, block: Block, tensor: torch.Tensor, rows: range) -> torch.Tensor:
        return tensor.narrow(self.tensors[block.name].dim, rows.start, len(rows))

    # ---- training side -------------------------------------------------------------------------------
    @torch.no_grad()
    def _pack(self, bucket: Bucket) -> torch.Tensor:
        """The bytes of one bucket: the tensor's own memory for a single contiguous block, else a copy."""
        if len(bucket.blocks) == 1:
            view = self._block_view(
                bucket.blocks[0], self.local[bucket.blocks[0].name].detach(), bucket.blocks[0].src
            )
            if view.is_contiguous():
                return _flat(view)
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        for block in bucket.blocks:
            src = self._block_view(block, self.local[block.name].detach(), block.src)
            out = buf[block.offset : block.offset + block.nbytes].view(src.dtype).view(src.shape)
            out.copy_(src)
        return buf

    def send(self) -> dict[str, float]:
        """Training rank: send this rank's part of every rollout shard (collective with `receive`)."""
        start, sent, pending = time.perf_counter(), 0, []
        for buckets in self.sends:
            bufs = [self._pack(b) for b in buckets]
            ops = [dist.P2POp(dist.isend, buf, peer=b.dst, group=self.world) for b, buf in zip(buckets, bufs)]
            works = dist.batch_isend_irecv(ops) if ops else []
            for work in pending:  # the previous round, while this one is in flight
                work.wait()
            pending = works
            sent += sum(b.nbytes for b in buckets)
        for work in pending:
            work.wait()
        self.last_stats = {
            "sent_bytes": sent,
            "rounds": self.num_rounds,
            "seconds": time.perf_counter() - start,
        }
        return self.last_stats

    # ---- rollout side --------------------------------------------------------------------------------
    def _receive_target(self, bucket: Bucket) -> tuple[torch.Tensor, bool]:
        """Where a bucket lands: the rollout tensor itself for a single contiguous block, else staging."""
        if len(bucket.blocks) == 1:
            block = bucket.blocks[0]
            view = self._block_view(block, self.params[block.name], block.dst)
            if view.is_contiguous():
                return _flat(view), True
        return torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device), False

    @torch.no_grad()
    def _unpack(self, bucket: Bucket, buf: torch.Tensor) -> None:
        for block in bucket.blocks:
            dst = self._block_view(block, self.params[block.name], block.dst)
            dst.copy_(buf[block.offset : block.offset + block.nbytes].view(dst.dtype).view(dst.shape))

    def receive(self) -> RolloutWeights:
        """Rollout rank: receive this rank's rollout shard (collective with `send`); the returned tensors are
        this object's and are overwritten by the next `receive`."""
        start, received, pending = time.perf_counter(), 0, []
        for buckets in self.recvs:
            targets = [self._receive_target(b) for b in buckets]
            ops = [
                dist.P2POp(dist.irecv, t, peer=b.src, group=self.world) for b, (t, _) in zip(buckets, targets)
            ]
            works = dist.batch_isend_irecv(ops) if ops else []
            self._finish(pending)  # unpack the previous round while this one arrives
            pending = [(works, buckets, targets)]
            received += sum(b.nbytes for b in buckets)
        self._finish(pending)
        self.last_stats = {
            "received_bytes": received,
            "rounds": self.num_rounds,
            "seconds": time.perf_counter() - start,
        }
        j, _ = self.layout.rollout_coords(self.rank)
        tg = self.layout.rollout_tp
        return RolloutWeights(
            params=dict(self.params),
            tp_size=tg,
            tp_rank=j,
            tp_group=self.tp_group if tg > 1 else None,
            micro_dp_group=None,
            micro_dp_rank=0,
            micro_dp_size=1,
        )

    def _finish(self, pending: list) -> None:
        for works, buckets, targets in pending:
            for work in works:
                work.wait()
            for bucket, (buf, direct) in zip(buckets, targets):
                if not direct:
                    self._unpack(bucket, buf)
