"""One MoE layer's weights in the native rollout and its routed experts (engine/models/moe.py), for
engine/rollout/model.py.

Where `torch._grouped_mm` runs (engine/models/moe.py `grouped_experts_run`: CUDA sm90/sm100 in bfloat16, and
CPU) the experts run as grouped GEMMs on stacked (experts, out, in) weights, with no host sync, so the decode
step is captured in CUDA graphs as a dense one is (`use_cuda_graphs`; graph decode equals eager decode for
Qwen3-MoE and Qwen2-MoE on an H200: tests/engine/test_moe_gpu.py); elsewhere they run as a loop over the experts that syncs with the host, and the engine decodes
eagerly (`decode_graph_safe`).

Memory: the stacked weights are views when a layer's experts are consecutive slices of one buffer (the
rollout benchmark's layout); otherwise (the weight transition hands over one tensor per expert) they are one
copy of the layer's routed-expert weights, built at the layer's first forward and held until `free_stacked`
(the engine's `release`) or until the weights are replaced: up to the routed experts' bytes on top of the
rollout weights while a rollout runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.models import moe
from engine.models.builder import ModelShape, MoEShape


def decode_graph_safe(shape: ModelShape, device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """Whether the native decode step of `shape` runs without host syncs on `device` in `dtype` (default
    `shape.dtype`): dense models always, MoE models where the grouped experts run on CUDA."""
    if shape.moe is None:
        return True
    dtype = dtype or shape.dtype
    return device.type == "cuda" and moe.grouped_experts_run(
        device, dtype, shape.hidden_size, shape.moe.ffn_hidden_size
    )


def use_cuda_graphs(
    shape: ModelShape, device: torch.device, wanted: bool | None, dtype: torch.dtype | None = None
) -> bool:
    """Whether the native engine captures its decode step in CUDA graphs: `wanted` (None: on CUDA wherever the
    step has no host sync: dense models, and MoE models whose experts run as grouped GEMMs); an error when
    wanted where the step syncs with the host."""
    safe = device.type == "cuda" and decode_graph_safe(shape, device, dtype)
    if wanted is None:
        return safe
    if wanted and not safe:
        raise ValueError(
            f"rollout.cuda_graphs=true: the native MoE forward syncs with the host on {device} in "
            f"{dtype or shape.dtype} (its grouped expert GEMMs need CUDA sm90/sm100 and bfloat16), which a CUDA "
            "graph cannot capture; set rollout.cuda_graphs=false"
        )
    return wanted


@dataclass
class MoEWeights:
    """One MoE layer: router and routed experts whole on every rollout-TP rank (expert TP is 1), the shared
    expert split over TP like a dense MLP."""

    router: torch.Tensor
    expert_fc1: list[torch.Tensor]
    """Expert e's [gate; up] (2f, h)."""
    expert_fc2: list[torch.Tensor]
    """Expert e's down projection (h, f)."""
    shared_fc1: torch.Tensor | None
    shared_fc2: torch.Tensor | None
    shared_gate: torch.Tensor | None
    grouped: bool = False
    """Run the experts as grouped GEMMs (no host sync) rather than as a loop over the experts."""
    fc1_efh: torch.Tensor | None = None
    """The experts' fc1 stacked (experts, 2f, h) while built (grouped path)."""
    fc2_ehf: torch.Tensor | None = None

    def routed(self, x_th: torch.Tensor, shape: MoEShape) -> tuple[torch.Tensor, torch.Tensor]:
        """(output (t, h), expert indices (t, k)) of the routed experts on tokens `x_th` (t, h)."""
        if not self.grouped:
            return moe.routed_experts(x_th, self.router, self.expert_fc1, self.expert_fc2, shape)
        self.stack()
        return moe.grouped_routed_experts(x_th, self.router, self.fc1_efh, self.fc2_ehf, shape)

    def stack(self) -> None:
        """Build the stacked expert weights of the grouped path (views or one copy) if they are not built."""
        if self.grouped and self.fc1_efh is None:
            self.fc1_efh, self.fc2_ehf = (
                moe.stack_experts(self.expert_fc1),
                moe.stack_experts(self.expert_fc2),
            )

    def free_stacked(self) -> None:
        self.fc1_efh = self.fc2_ehf = None


def moe_layer(
    p: dict[str, torch.Tensor],
    pre: str,
    shape: MoEShape,
    required: Callable[[dict[str, torch.Tensor], str], torch.Tensor],
) -> MoEWeights:
    """Layer `pre` (`decoder.layers.{i}.mlp.`)'s MoE weights from the rollout params `p`; `required(p, name)`
    reads a tensor that must be there."""
    experts = range(shape.num_experts)
    fc1 = [required(p, f"{pre}experts.local_experts.{e}.linear_fc1.weight") for e in experts]
    return MoEWeights(
        router=required(p, pre + "router.weight"),
        expert_fc1=fc1,
        expert_fc2=[required(p, f"{pre}experts.local_experts.{e}.linear_fc2.weight") for e in experts],
        shared_fc1=p.get(pre + "shared_experts.linear_fc1.weight"),
        shared_fc2=p.get(pre + "shared_experts.linear_fc2.weight"),
        shared_gate=p.get(pre + "shared_experts.gate_weight"),
        grouped=moe.grouped_experts_run(fc1[0].device, fc1[0].dtype, fc1[0].shape[1], shape.ffn_hidden_size),
    )
