"""Rollout-layout shards into vLLM's own parameters, shard by shard: no rank ever holds a full tensor.

At equal TP a rank's rollout shard IS its vLLM shard up to layout, because both split heads, FFN columns
and rows the same way (megatron requires query groups divisible by TP, so vLLM never replicates KV heads):
- `linear_qkv` is [q_g; k_g; v_g] per query group; vLLM's `qkv_proj` is [q; k; v] of the rank's heads:
  regroup the shard (`hf_pieces_of_shard`) and copy the three parts into their row ranges;
- `linear_fc1` is [gate_r; up_r] on rank r, exactly vLLM's `gate_up_proj` shard: copied as is;
- row-parallel `linear_proj` / `linear_fc2` and the replicated norms: copied as is;
- mixture of experts (vLLM's Qwen3MoeForCausalLM / Qwen2MoeForCausalLM, expert parallelism off in vLLM): the
  router `mlp.gate` and Qwen2-MoE's `mlp.shared_expert_gate` are replicated, the shared expert is a dense
  MLP (`mlp.shared_expert.gate_up_proj` / `down_proj`, split as above). The routed experts of a layer are
  two fused tensors of FusedMoE that split every expert's intermediate dim I over TP. In vLLM 0.26
  `FusedMoE(...)` builds a MoERunner (`mlp.experts`) whose RoutedExperts submodule `routed_experts` owns them:
  `mlp.experts.routed_experts.w13_weight` (experts, 2*I/T, hidden) = [gate rows of rank r; up rows of rank r]
  per expert and `mlp.experts.routed_experts.w2_weight` (experts, hidden, I/T) = the down projection's input
  columns of rank r. Our rollout holds every expert whole on each rollout-TP rank (expert TP is 1;
  parallel/expert_gather.py brings the experts a rank lacks under expert parallelism), so rank r copies its
  rows / columns of expert e straight into slot e (`copy_expert`). This is the layout of vLLM's unquantized
  Triton MoE backend, which engine/rollout/vllm_backend.py pins (`moe_backend="triton"`): its
  `process_weights_after_loading` re-registers the same storage unchanged and the kernel reads the registered
  parameter at every forward; the FlashInfer backends (auto-selected on GPUs other than Hopper) reorder or
  block-shuffle w13 / w2;
- embedding / output layer rows: megatron pads the vocabulary to a multiple of TP, vLLM to a multiple of 64
  and then splits it, so rank r's rows differ when the two paddings differ (tiny vocabularies; not Qwen's
  151936 at TP <= 8). Then each rank sends each peer the rows it owns of that peer's vLLM range, one
  batched point-to-point exchange inside the rollout TP group (rows beyond the vocabulary are zeroed).

Names come from the HF weight map (engine/models/hf_map.py) with vLLM's fused names (`qkv_proj`,
`gate_up_proj`, `experts.routed_experts.w13_weight` / `w2_weight`): the names of `named_parameters()` of
vLLM 0.26's Llama/Qwen2/Qwen3/Qwen3-MoE/Qwen2-MoE models. Works on plain
tensors (no vllm import), so it is tested on CPU against vLLM's sharding rules.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.models.builder import ModelShape
from engine.models.hf_map import Split, hf_names, hf_pieces_of_shard, local_expert, match_rule

VLLM_VOCAB_PADDING = 64
"""vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE."""
VLLM_ROUTED_EXPERTS = "mlp.experts.routed_experts"
"""Module of a layer's fused routed-expert tensors in vLLM 0.26 (MoERunner.routed_experts, a RoutedExperts)."""


def vllm_param_name(name: str) -> str:
    """vLLM parameter of rollout tensor `name` (global layer ids), e.g.
    decoder.layers.3.self_attention.linear_qkv.weight -> model.layers.3.self_attn.qkv_proj.weight."""
    rule, layer = match_rule(name)
    if rule.expert:  # one fused tensor per layer for all routed experts (FusedMoE)
        fused = "w13_weight" if rule.split is Split.GATE_UP else "w2_weight"
        return f"model.layers.{layer}.{VLLM_ROUTED_EXPERTS}.{fused}"
    first = hf_names(rule, layer)[0]
    if rule.split is Split.QKV:
        return first.replace("q_proj", "qkv_proj")
    if rule.split is Split.GATE_UP:
        return first.replace("gate_proj", "gate_up_proj")
    return first


def vllm_vocab_rows(vocab_size: int, tp: int) -> int:
    """Rows of vLLM's embedding / LM-head shard: the vocabulary padded to 64, split over TP."""
    padded = -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    return -(-padded // tp)


def vocab_pieces(vocab_size: int, src_rows: int, dst_rows: int, tp: int) -> list[tuple[int, int, int, int]]:
    """(src rank, dst rank, first, last + 1 global row) for every real vocabulary row range that rank `src`
    holds (rows [src*src_rows, (src+1)*src_rows)) and rank `dst` needs (rows [dst*dst_rows, ...))."""
    pieces = []
    for src in range(tp):
        for dst in range(tp):
            lo = max(src * src_rows, dst * dst_rows)
            hi = min((src + 1) * src_rows, (dst + 1) * dst_rows, vocab_size)
            if lo < hi:
                pieces.append((src, dst, lo, hi))
    return pieces


@torch.no_grad()
def reshard_vocab_rows(
    dst: torch.Tensor,
    src: torch.Tensor,
    vocab_size: int,
    tp_rank: int,
    tp: int,
    group: dist.ProcessGroup | None,
) -> int:
    """Fill `dst` (this rank's vLLM vocab shard) from `src` (its megatron vocab shard); collective over the
    rollout TP group when the row ranges differ. Returns the bytes received from peers."""
    src_rows, dst_rows = src.shape[0], dst.shape[0]
    if src_rows == dst_rows or tp == 1:
        real = max(0, min(dst_rows, vocab_size - tp_rank * dst_rows))
        dst[:real].copy_(src[:real])
        dst[real:].zero_()
        return 0
    ops, received = [], 0
    for s, d, lo, hi in vocab_pieces(vocab_size, src_rows, dst_rows, tp):
        if s == tp_rank and d == tp_rank:
            dst[lo - d * dst_rows : hi - d * dst_rows].copy_(src[lo - s * src_rows : hi - s * src_rows])
        elif s == tp_rank:
            peer = dist.get_global_rank(group, d)
            ops.append(
                dist.P2POp(dist.isend, src[lo - s * src_rows : hi - s * src_rows], peer=peer, group=group)
            )
        elif d == tp_rank:
            buf = dst[lo - d * dst_rows : hi - d * dst_rows]
            ops.append(dist.P2POp(dist.irecv, buf, peer=dist.get_global_rank(group, s), group=group))
            received += buf.numel() * buf.element_size()
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    real = max(0, min(dst_rows, vocab_size - tp_rank * dst_rows))
    dst[real:].zero_()
    return received


@torch.no_grad()
def copy_shard(dst: torch.Tensor, name: str, shard: torch.Tensor, shape: ModelShape, tp: int) -> None:
    """Copy the non-vocabulary rollout shard `name` into its vLLM parameter `dst` (layouts above)."""
    rule, _ = match_rule(name)
    if rule.split is Split.QKV:
        parts = hf_pieces_of_shard(rule, shard, shape, tp)  # q, k, v rows of this rank's heads
        if sum(p.shape[0] for p in parts) != dst.shape[0] or parts[0].shape[1:] != dst.shape[1:]:
            raise ValueError(_shape_error(name, dst, shard))
        start = 0
        for part in parts:
            dst[start : start + part.shape[0]].copy_(part)
            start += part.shape[0]
        return
    if dst.shape != shard.shape:
        raise ValueError(_shape_error(name, dst, shard))
    dst.copy_(shard)


@torch.no_grad()
def copy_expert(dst: torch.Tensor, name: str, shard: torch.Tensor, tp_rank: int, tp: int) -> int:
    """Copy rank `tp_rank`'s part of the whole routed expert `name` into its slot of vLLM's fused expert
    tensor `dst` (w13: [gate rows; up rows], w2: input columns; layouts above). Returns the expert index."""
    expert = local_expert(name)  # rollout names carry global expert indices
    fc1 = match_rule(name)[0].split is Split.GATE_UP
    rows = dst.shape[1] // 2 if fc1 else dst.shape[2]  # I / T
    whole = (2 * rows * tp, dst.shape[2]) if fc1 else (dst.shape[1], rows * tp)
    if expert >= dst.shape[0] or tuple(shard.shape) != whole:
        raise ValueError(
            f"vLLM parameter {vllm_param_name(name)} has shape {tuple(dst.shape)} (experts, ...) but the rollout "
            f"expert {name} has {tuple(shard.shape)}: vLLM's tensor_parallel_size must equal rollout.tp and its "
            "config.json must describe this model (num_experts, moe_intermediate_size)"
        )
    lo, hi = tp_rank * rows, (tp_rank + 1) * rows
    if fc1:
        gate, up = shard.chunk(2)  # the whole expert's fc1 is [gate; up] (Split.GATE_UP at TP 1)
        dst[expert, :rows].copy_(gate[lo:hi])
        dst[expert, rows:].copy_(up[lo:hi])
    else:
        dst[expert].copy_(shard[:, lo:hi])
    return expert


def _shape_error(name: str, dst: torch.Tensor, shard: torch.Tensor) -> str:
    return (
        f"vLLM parameter {vllm_param_name(name)} has shape {tuple(dst.shape)} but the rollout shard {name} "
        f"has {tuple(shard.shape)}: vLLM's tensor_parallel_size must equal rollout.tp and its config.json "
        "must describe this model"
    )


def load_rollout_weights(
    vllm_params: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    shape: ModelShape,
    tp_rank: int,
    tp: int,
    group: dist.ProcessGroup | None,
) -> dict[str, int]:
    """Copy every rollout shard in `params` into vLLM's `vllm_params` (named_parameters of vLLM's model on
    this rank). Every vLLM parameter (every expert slot of a fused expert tensor) must be written exactly
    once, or this raises (a parameter left at its dummy init would generate garbage silently). Collective
    over the rollout TP group (vocab rows)."""
    written: set[str] = set()
    experts_written: dict[str, list[int]] = {}
    stats = {"tensors": 0, "bytes_copied": 0, "bytes_received": 0}
    for name in sorted(params):  # the same order on every rank of the group (the vocab exchange pairs up)
        shard = params[name]
        target = vllm_param_name(name)
        if target not in vllm_params:
            raise KeyError(
                f"vLLM's model has no parameter {target!r} for rollout tensor {name!r}; vLLM parameters "
                f"look like {sorted(vllm_params)[:4]}: check the model architecture in its config.json"
            )
        dst = vllm_params[target].data
        rule = match_rule(name)[0]
        if rule.expert:
            experts_written.setdefault(target, []).append(copy_expert(dst, name, shard, tp_rank, tp))
            stats["bytes_copied"] += dst[0].numel() * dst.element_size()
        else:
            if rule.split is Split.VOCAB:
                stats["bytes_received"] += reshard_vocab_rows(
                    dst, shard, shape.vocab_size, tp_rank, tp, group
                )
            else:
                copy_shard(dst, name, shard, shape, tp)
            stats["bytes_copied"] += dst.numel() * dst.element_size()
        written.add(target)
        stats["tensors"] += 1
    for target, experts in experts_written.items():
        if sorted(experts) != list(range(vllm_params[target].shape[0])):
            raise KeyError(
                f"rollout experts {sorted(experts)} fill vLLM's {target} with {vllm_params[target].shape[0]} "
                "expert slots: every expert of the layer must be written exactly once"
            )
    # k_scale / v_scale / q_scale / prob_scale: attention layers' KV-cache quantisation scales, not weights
    missing = sorted(n for n in set(vllm_params) - written if not n.rsplit(".", 1)[-1].endswith("_scale"))
    if missing:
        raise KeyError(f"rollout weights leave vLLM parameters unwritten: {missing[:6]}")
    return stats
