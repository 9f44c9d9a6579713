"""The mixture-of-experts MLP as plain functions of its weights: megatron's top-k router numerics
(`megatron.core.transformer.moe.moe_utils.topk_routing_with_score_function`, unfused) and the experts, for
the native rollout engine and for tests of the training modules. Two expert paths with the same router:
- `routed_experts`: a loop of SwiGLU MLPs over the experts, each on the tokens that chose it (found with
  `nonzero`: a host sync per expert, so a CUDA graph cannot capture it); any device and dtype;
- `grouped_routed_experts`: no host sync, static shapes. The (token, k) assignments are sorted by expert on
  the device, the per-expert row offsets found by `searchsorted`, both GEMMs of every expert run as one
  `torch._grouped_mm` each on stacked weights (E, out, in), and each token's k outputs are summed in
  ascending expert order, the order in which `routed_experts` adds them. `torch._grouped_mm` is free of host
  syncs only on CUDA sm90/sm100 in bfloat16 (its CUTLASS kernel; elsewhere on CUDA it copies the offsets to
  the host); on CPU it loops over the groups on the host, where there is no device to wait for
  (`grouped_experts_run` says where this path runs).

Router, per token: logits = x . router_weight^T (in x's dtype, like Hugging Face's Qwen-MoE gate), then
- softmax, norm_topk_prob: top-k of the logits, softmax over those k (= the top-k softmax renormalised);
- softmax, not norm_topk_prob: softmax over all experts in float32, then top-k;
- sigmoid: sigmoid in float32, top-k, divided by their sum (k > 1).
The k weights are cast to x's dtype; the output is the weighted sum of the chosen experts' outputs, plus the
shared expert (times sigmoid(x . gate) when gated). Pure tensor code: no process groups, no megatron modules.

Where the router weight is applied: as megatron's experts do (`SequentialMLP`, `activation_func_with_probs`),
to the activation before an expert's down projection, fc2 . (w * swiglu(fc1 . x)); transformers and vLLM apply
it after, w * fc2 . swiglu(fc1 . x). The same value, rounded differently in bfloat16: with megatron's order this
forward is bit-identical to the training layer on CPU in bf16 (tests/engine/test_moe.py), with the other it
sat 0.29 (Qwen2-MoE) / 0.17 (Qwen3-MoE) nat mean from the training forward's log-probs on tiny random-init
models (transformers' own bf16 forward is 1.09 / 0.23 nat mean from its float32 one: bf16 noise, which the
rollout should share with training rather than with transformers). In float32 the orders agree to ~1e-6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.builder import MoEShape


def route(logits_te: torch.Tensor, moe: MoEShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (tokens, k) in the logits' dtype, expert indices (tokens, k)) from router logits (tokens, experts)."""
    k = moe.top_k
    if moe.score_function == "softmax":
        if moe.norm_topk_prob:
            top, index = logits_te.topk(k, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=torch.float32)
        else:
            scores = torch.softmax(logits_te, dim=-1, dtype=torch.float32).type_as(logits_te)
            weights, index = scores.topk(k, dim=-1)
    elif moe.score_function == "sigmoid":
        scores = torch.sigmoid(logits_te.float()).type_as(logits_te)
        weights, index = scores.topk(k, dim=-1)
        if k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown router score function {moe.score_function!r}")
    return weights.type_as(logits_te), index


def swiglu_mlp(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP with megatron's fused fc1 = [gate; up]: (t, h) -> (t, h)."""
    gate, up = (x @ fc1.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ fc2.t()


def routed_experts(
    x_th: torch.Tensor,
    router: torch.Tensor,
    expert_fc1: list[torch.Tensor],
    expert_fc2: list[torch.Tensor],
    moe: MoEShape,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (t, h), expert indices (t, k)) of the routed experts: each token through its k experts, the
    outputs summed with the router's weights. `expert_fc1[e]` (2f, h) and `expert_fc2[e]` (h, f) are expert
    e's weights (all experts: the rollout holds them whole)."""
    weights_tk, index_tk = route(x_th @ router.t().to(x_th.dtype), moe)
    out = torch.zeros_like(x_th)
    for e in range(moe.num_experts):
        rows, slot = (index_tk == e).nonzero(as_tuple=True)
        if rows.numel():
            gate, up = (x_th[rows] @ expert_fc1[e].t()).chunk(2, dim=-1)
            act = F.silu(gate) * up * weights_tk[rows, slot, None]  # megatron's rounding order
            out.index_add_(0, rows, act @ expert_fc2[e].t())
    return out, index_tk


def grouped_mm_sync_free(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs here without a host sync: CUDA compute capability 9.x or 10.x in
    bfloat16 (the CUTLASS grouped GEMM); its other CUDA path copies the offsets to the host."""
    return (
        hasattr(torch, "_grouped_mm")
        and device.type == "cuda"
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device)[0] in (9, 10)
    )


def grouped_experts_run(device: torch.device, dtype: torch.dtype, hidden: int, ffn: int) -> bool:
    """Whether `grouped_routed_experts` runs on `device` in `dtype` for experts (hidden -> ffn -> hidden):
    `torch._grouped_mm` takes rows of a multiple of 16 bytes; on CUDA only where it is sync-free, on CPU in
    float32, bfloat16 or float16."""
    if not hasattr(torch, "_grouped_mm") or any(n * dtype.itemsize % 16 for n in (hidden, ffn)):
        return False
    if device.type == "cuda":
        return grouped_mm_sync_free(device, dtype)
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)


def stack_experts(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(E, *shape) with `tensors[e]` at [e]: a view (no copy) when they are consecutive slices of one
    contiguous buffer (one (E, ...) tensor per layer, as the rollout benchmark lays them out), otherwise one
    copy of them (the caller owns it and frees it with the weights)."""
    first = tensors[0].detach()
    n, ptr = first.numel(), first.untyped_storage().data_ptr()
    consecutive = all(
        t.shape == first.shape
        and t.is_contiguous()
        and t.untyped_storage().data_ptr() == ptr
        and t.storage_offset() == first.storage_offset() + e * n
        for e, t in enumerate(tensors)
    )
    if consecutive and first.data_ptr() % 16 == 0:
        return first.as_strided((len(tensors), *first.shape), (n, *first.stride()), first.storage_offset())
    return torch.stack([t.detach() for t in tensors])


def sort_by_expert(index_tk: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order (t*k,), ends (experts,) int32) for expert choices `index_tk` (t, k): the flat assignments
    (token-major) sorted stably by expert, and each expert's end offset in that order (expert e's rows are
    [ends[e-1], ends[e]); an expert with no token has an empty range). No host sync."""
    flat = index_tk.reshape(-1)
    order = flat.argsort(stable=True)
    bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=flat.dtype)
    return order, torch.searchsorted(flat[order], bounds).to(torch.int32)


def grouped_routed_experts(
    x_th: torch.Tensor,
    router: torch.Tensor,
    fc1_efh: torch.Tensor,
    fc2_ehf: torch.Tensor,
    moe: MoEShape,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`routed_experts` without host syncs: `fc1_efh` (experts, 2f, h) and `fc2_ehf` (experts, h, f) are the
    experts' weights stacked (`stack_experts`). Returns (output (t, h), expert indices (t, k) as the router
    ranked them)."""
    t, k = x_th.shape[0], moe.top_k
    weights_tk, index_tk = route(x_th @ router.t().to(x_th.dtype), moe)
    by_expert, slot_tk = index_tk.sort(dim=-1)  # each token's k outputs are summed in expert order
    weights_tk = weights_tk.gather(-1, slot_tk)
    order, ends = sort_by_expert(by_expert, moe.num_experts)
    x_sorted = x_th[order // k]  # (t*k, h), grouped by expert
    gate, up = torch._grouped_mm(x_sorted, fc1_efh.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    act = F.silu(gate) * up * weights_tk.reshape(-1)[order, None]  # megatron's rounding order
    y = torch._grouped_mm(act, fc2_ehf.transpose(1, 2), offs=ends)  # (t*k, h)
    y_tkh = y[order.argsort()].view(t, k, -1)  # a gather: deterministic, unlike a scatter on CUDA
    out = y_tkh[:, 0]
    for j in range(1, k):
        out = out + y_tkh[:, j]
    return out, index_tk


def shared_expert(
    x_th: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, gate: torch.Tensor | None
) -> torch.Tensor:
    """The shared expert (t, h) -> (t, h) (a partial sum when fc1/fc2 are TP shards), times
    sigmoid(x . gate^T) when `gate` (1, h) is given."""
    out = swiglu_mlp(x_th, fc1, fc2)
    if gate is not None:
        out = torch.sigmoid(x_th @ gate.t()) * out
    return out
