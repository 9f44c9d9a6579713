"""The mixture-of-experts MLP as plain functions of its weights: megatron's top-k router numerics
(`megatron.core.transformer.moe.moe_utils.topk_routing_with_score_function`, unfused) and the experts as a
loop of SwiGLU MLPs, for the native rollout engine and for tests of the training modules.

Router, per token: logits = x . router_weight^T (in x's dtype, like Hugging Face's Qwen-MoE gate), then
- softmax, norm_topk_prob: top-k of the logits, softmax over those k (= the top-k softmax renormalised);
- softmax, not norm_topk_prob: softmax over all experts in float32, then top-k;
- sigmoid: sigmoid in float32, top-k, divided by their sum (k > 1).
The k weights are cast to x's dtype; the output is the weighted sum of the chosen experts' outputs, plus the
shared expert (times sigmoid(x . gate) when gated). Pure tensor code: no process groups, no megatron modules.
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
            y = swiglu_mlp(x_th[rows], expert_fc1[e], expert_fc2[e])
            out.index_add_(0, rows, y * weights_tk[rows, slot, None])
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
