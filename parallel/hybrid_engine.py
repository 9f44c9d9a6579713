"""The 3D-HybridEngine (HybridFlow, arXiv 2409.19256, sec. 5): regroup the actor's training shards
(t, p) into the rollout layout (t_g, p_g) inside each micro-DP group, and back, with no second copy of the
model on any rank.

How it works (the plan is computed once, in `parallel/hybrid_plan.py`):
- at construction every training parameter's `.data` is re-pointed into ONE contiguous buffer T per rank,
  ordered by how far each tensor travels, so that what a peer needs is a prefix of T;
- `to_rollout` is HybridFlow's all-gather inside the micro-DP group, done as ONE batched point-to-point
  exchange (`dist.batch_isend_irecv`: a single NCCL group call) in which each member sends its prefix of T
  to every peer and receives the peers' messages into one receive buffer G. Rollout tensors are views:
  this rank's own training tensors where its rollout shard equals its training shard (t_g = t, any p_g),
  slices of G for the layers of the other stages. Nothing is copied and nothing of the own shard is
  duplicated: the gathered part G is written around the shard already in place;
- `to_train` drops G (and the rollout views handed out) unless `keep_rollout_weights`; the training
  parameters were never written, so they are bit-identical and still the optimizer's parameters.

Where this departs from the paper, and why:
- not `all_gather_into_tensor`: that collective needs one output buffer holding every member's slot,
  including the caller's own, so the own shard would either be duplicated or the training parameters would
  live inside the big buffer and could not be released on the way back. The batched exchange moves the same
  bytes per rank ((m-1)/m of the rollout shard) and also lets members send unequal sizes (the embedding
  and output layer sit on the first and last stage) without padding;
- TP merge (t_g < t): megatron shards row-parallel weights along dim 1 and stores the SwiGLU fc1 as
  [gate_i; up_i], so a wider shard is a regrouping of the narrower ones, not a concatenation: no view of
  one buffer can be both. Those rollout tensors are assembled by one local copy each into a regroup buffer
  B, the receive buffer is staged in buckets of `bucket_bytes` per sender and freed, and the training
  shard T stays where it is: rollout weights then cost M/(t_g*p_g) + M/(t*p) per rank (one extra copy of
  the own shard, 1/m of the rollout shard), measured by `alive_bytes()`;
- megatron's distributed optimizer keeps parameters as views of DDP's contiguous `param_data` buffers,
  which it all-gathers into after every step, so they cannot be re-pointed: the engine detects this
  (`in_place` False) and packs a transient copy of the own shard for sending instead (freed at the end of
  `to_rollout`); the own rollout tensors are then views of the training parameters in DDP's buffer.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from parallel.hybrid_layout import HybridLayout, RolloutLayout
from parallel.hybrid_plan import MemberMeta, ParamMeta, RolloutTensor, Slot, TransitionPlan, plan_transition
from parallel.rollout_weights import RolloutWeights, global_param_names, is_expert_param
from parallel.state import ProcessGroups

DEFAULT_BUCKET_BYTES = 128 * 2**20


def _view(buf: torch.Tensor, slot: Slot, start: int = 0) -> torch.Tensor:
    """The tensor of `slot` inside a flat uint8 buffer whose byte 0 is at `start` of the slot's buffer."""
    lo = slot.offset - start
    return buf[lo : lo + slot.nbytes].view(slot.dtype).view(slot.shape)


def _owns_storage(param: torch.Tensor) -> bool:
    """Whether the parameter is the sole, whole user of its storage (megatron's distributed optimizer makes
    parameters views of a shared buffer; those cannot be re-pointed)."""
    data = param.data
    return (
        data.is_contiguous()
        and data.storage_offset() == 0
        and data.untyped_storage().nbytes() == data.numel() * data.element_size()
    )


def _new_groups(rank_lists: list[list[int]], rank: int, timeout) -> dist.ProcessGroup:
    """Create every group of a partition of the ranks (all ranks call this in the same order); return ours.
    `timeout` is `cluster.timeout_s`, so a dead peer fails the rollout groups as fast as the training ones."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


class HybridEngine:
    """Train -> rollout -> train weight transitions of the actor, zero-redundancy (see module docstring).

    `chunks` are this rank's model chunks (one per virtual stage; DDP/Float16 wrappers allowed), `groups` the
    training groups. Construct it after megatron DDP and the optimizer (so that parameters live where they
    will stay) and call it on every rank in the same order: the constructor creates process groups.
    `rollout_tp` / `rollout_pp` are `rollout.tp` / `rollout.pp` (ValueError naming the key unless they divide
    `parallel.tp` / `parallel.pp`); `keep_rollout_weights` keeps the gathered part between transitions;
    `bucket_bytes` bounds, per sender, the staging of a regrouping transition (None: one exchange);
    `skip_experts` leaves the routed experts out (at parallel.ep > 1 `ExpertGather` moves them).
    Rollout tensors are read-only views: some share memory with the training parameters.
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        groups: ProcessGroups,
        num_layers: int,
        tie_embeddings: bool,
        rollout_tp: int,
        rollout_pp: int = 1,
        keep_rollout_weights: bool = False,
        bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
        skip_experts: bool = False,
    ):
        dims = groups.dims
        train = dims.train_layout()
        self.layout = HybridLayout(train, RolloutLayout(tp=rollout_tp, pp=rollout_pp))  # validates rollout.*
        self.groups = groups
        self.keep_rollout_weights = keep_rollout_weights
        self.local = global_param_names(chunks, train.layers(groups.pp_rank, num_layers))
        if skip_experts:  # moved by parallel/expert_gather.py (expert parallelism: ranks hold other experts)
            self.local = {n: p for n, p in self.local.items() if not is_expert_param(n)}
        if not self.local:
            raise ValueError("HybridEngine: the model chunks have no parameters")
        self.device = next(iter(self.local.values())).device
        has_output = "output_layer.weight" in self.local
        if groups.is_last_stage and not tie_embeddings and not has_output:
            raise ValueError(
                "tie_embeddings=False but the last stage has no output_layer.weight: pass the "
                "model's model.tie_embeddings"
            )
        if tie_embeddings and dims.pp == 1 and has_output:
            raise ValueError(
                "tie_embeddings=True but the model has its own output_layer.weight: pass the "
                "model's model.tie_embeddings"
            )
        rank = groups.rank
        self.tp_group = _new_groups(self.layout.rollout_tp_groups(), rank, groups.timeout)
        self.pp_group = _new_groups(self.layout.rollout_pp_groups(), rank, groups.timeout)
        self.micro_dp_group = _new_groups(self.layout.micro_dp_groups(), rank, groups.timeout)
        self.coords = self.layout.rollout_coords(rank)

        position = self.coords.micro_dp_rank
        meta = [ParamMeta(n, tuple(p.shape), p.dtype) for n, p in self.local.items()]
        gathered: list = [None] * self.layout.micro_dp_size
        dist.all_gather_object(gathered, (rank, meta), group=self.micro_dp_group)
        members = [MemberMeta(i, r, tuple(m)) for i, (r, m) in enumerate(gathered)]
        if members[position].rank != rank:
            raise RuntimeError("micro-DP group order differs from HybridLayout.micro_dp_groups")
        self.plan: TransitionPlan = plan_transition(
            self.layout, members, position, tie_embeddings, bucket_bytes
        )
        self._slots = {s.name: s for s in self.plan.send[position].slots}
        self._recv_at = self._receive_index()
        self.in_place = all(_owns_storage(p) for p in self.local.values())
        self._train_buf = self._repoint() if self.in_place else None
        self._recv: list[torch.Tensor | None] = [None] * self.plan.num_rounds
        self._regroup_buf: torch.Tensor | None = None
        self._weights: RolloutWeights | None = None
        self.last_stats: dict[str, float] = {}

    # ---- construction helpers ------------------------------------------------------------------
    def _receive_index(self) -> dict[tuple[int, str], tuple[int, int, Slot]]:
        """(sender position, name) -> (round, byte offset in that round's receive buffer, sender's slot)."""
        index = {}
        for incoming in self.plan.incoming:
            for msg in incoming:
                for slot in self.plan.send[msg.src].slots:
                    if slot.offset >= msg.src_range.start and slot.end <= msg.src_range.stop:
                        index[(msg.src, slot.name)] = (
                            msg.round,
                            msg.dst_offset + slot.offset - msg.src_range.start,
                            slot,
                        )
        return index

    @torch.no_grad()
    def _repoint(self) -> torch.Tensor:
        """Move every training parameter into the training buffer T (once); returns T."""
        layout = self.plan.send[self.plan.position]
        buf = torch.empty(layout.total_bytes, dtype=torch.uint8, device=self.device)
        for slot in layout.slots:
            param = self.local[slot.name]
            view = _view(buf, slot)
            view.copy_(param.data)
            param.data = view
        return buf

    def _check_in_place(self) -> None:
        """Fall back to copy mode if someone re-pointed the parameters after construction (e.g. megatron DDP
        with the distributed optimizer built after the engine)."""
        if not self.in_place:
            return
        base = self._train_buf.data_ptr()
        if all(self.local[n].data_ptr() == base + s.offset for n, s in self._slots.items()):
            return
        warnings.warn(
            "HybridEngine: parameters were re-pointed after the engine was built; sending a copy of the own "
            "shard from now on (build the engine after megatron DDP and the optimizer)",
            stacklevel=3,
        )
        self.in_place, self._train_buf = False, None

    @torch.no_grad()
    def _pack(self) -> torch.Tensor:
        """Copy mode: the own shard's sent prefix, packed into a transient send buffer."""
        layout = self.plan.send[self.plan.position]
        buf = torch.empty(layout.send_bytes, dtype=torch.uint8, device=self.device)
        for slot in layout.slots:
            if slot.end <= layout.send_bytes:
                _view(buf, slot).copy_(self.local[slot.name].data)
        return buf

    # ---- transitions ---------------------------------------------------------------------------
    def _exchange(self, round_: int, send_buf: torch.Tensor, recv_buf: torch.Tensor) -> tuple[int, int]:
        """One batched exchange inside the micro-DP group; returns (bytes received, bytes sent)."""
        members, ops = self.plan.members, []
        received = sent = 0
        for msg in self.plan.incoming[round_]:
            buf = recv_buf[msg.dst_offset : msg.dst_offset + len(msg.src_range)]
            ops.append(dist.P2POp(dist.irecv, buf, peer=members[msg.src].rank, group=self.micro_dp_group))
            received += buf.numel()
        for msg in self.plan.outgoing[round_]:
            buf = send_buf[msg.src_range.start : msg.src_range.stop]
            ops.append(dist.P2POp(dist.isend, buf, peer=members[msg.dst].rank, group=self.micro_dp_group))
            sent += buf.numel()
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received, sent

    def _piece_source(self, position: int, name: str, recv_buf: torch.Tensor | None) -> torch.Tensor:
        if position == self.plan.position:
            return self.local[name].detach()
        _, offset, slot = self._recv_at[(position, name)]
        return recv_buf[offset : offset + slot.nbytes].view(slot.dtype).view(slot.shape)

    @torch.no_grad()
    def _assemble(self, tensor: RolloutTensor, recv_buf: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """The rollout tensor (a view, or a regrouped copy in B) and the bytes copied to build it."""
        if tensor.regroup_offset is None:
            (piece,) = tensor.pieces
            return self._piece_source(piece.position, piece.name, recv_buf), 0
        lo = tensor.regroup_offset
        out = self._regroup_buf[lo : lo + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        for piece in tensor.pieces:
            source = self._piece_source(piece.position, piece.name, recv_buf)
            for block in piece.blocks:
                dst = out.narrow(piece.dim, block.dst.start, len(block.dst))
                dst.copy_(source.narrow(piece.dim, block.src.start, len(block.src)))
        return out, tensor.nbytes

    def to_rollout(self) -> RolloutWeights:
        """This rank's rollout shard of the actor (views; valid until `to_train`)."""
        start = time.perf_counter()
        plan = self.plan
        self._check_in_place()
        send_buf = self._train_buf if self.in_place else self._pack()
        copied = 0 if self.in_place else plan.send[plan.position].send_bytes
        if plan.regroup_bytes and self._regroup_buf is None:
            self._regroup_buf = torch.empty(plan.regroup_bytes, dtype=torch.uint8, device=self.device)
        params = {t.name: self._assemble(t, None)[0] for t in plan.tensors if t.round == -1}
        received = sent = 0
        live = copied + plan.regroup_bytes + sum(b.numel() for b in self._recv if b is not None)
        peak = live
        for r in range(plan.num_rounds):
            recv_buf = self._recv[r]
            if recv_buf is None:
                recv_buf = torch.empty(plan.recv_bytes[r], dtype=torch.uint8, device=self.device)
                peak = max(peak, live + recv_buf.numel())
                live += 0 if plan.regroup else recv_buf.numel()
            got, put = self._exchange(r, send_buf, recv_buf)
            received, sent = received + got, sent + put
            for tensor in plan.tensors:
                if tensor.round == r:
                    params[tensor.name], n = self._assemble(tensor, recv_buf)
                    copied += n
            # without regrouping the receive buffer is the rollout storage; with it, a staging bucket
            self._recv[r] = None if plan.regroup else recv_buf
        params = {t.name: params[t.name] for t in plan.tensors}
        rl = self.layout.rollout
        self._weights = RolloutWeights(
            params=params,
            tp_size=rl.tp,
            tp_rank=self.coords.tp_rank,
            tp_group=self.tp_group if rl.tp > 1 else None,
            micro_dp_group=self.micro_dp_group if self.layout.micro_dp_size > 1 else None,
            micro_dp_rank=self.coords.micro_dp_rank,
            micro_dp_size=self.layout.micro_dp_size,
            pp_size=rl.pp,
            pp_rank=self.coords.pp_rank,
            pp_group=self.pp_group if rl.pp > 1 else None,
        )
        self.last_stats = {
            "received_bytes": received,
            "sent_bytes": sent,
            "copied_bytes": copied,
            "rounds": plan.num_rounds,
            "peak_buffer_bytes": peak,
            "seconds": time.perf_counter() - start,
        }
        return self._weights

    def to_train(self) -> None:
        """Back to the training layout: release the gathered part unless `keep_rollout_weights`.

        The rollout tensors handed out are removed from the returned `RolloutWeights.params`, so the memory is
        freed even if a rollout engine still holds that object. With `keep_rollout_weights` they stay valid
        (stale once the actor trains) and the next `to_rollout` refreshes them in place.
        """
        if self.keep_rollout_weights:
            return
        if self._weights is not None:
            self._weights.params.clear()
            self._weights = None
        self._recv = [None] * self.plan.num_rounds
        self._regroup_buf = None

    def alive_bytes(self) -> dict[str, int]:
        """Bytes of the buffers the engine holds now: `train` (T, the training shard), `gathered` (receive
        buffers kept as rollout storage) and `regrouped` (B)."""
        return {
            "train": 0 if self._train_buf is None else self._train_buf.numel(),
            "gathered": sum(b.numel() for b in self._recv if b is not None),
            "regrouped": 0 if self._regroup_buf is None else self._regroup_buf.numel(),
        }
