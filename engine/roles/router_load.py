"""How evenly an MoE model's routers spread tokens over the experts during a phase (the actor's update).

`RouterLoad` counts, while active, the tokens each router sends to each expert (forward hooks on megatron's
`TopKRouter`s; every position of a micro-batch counts, padding included) and reduces the counts over all ranks
of the role. Its metric, `moe_load_imbalance`, is the mean over layers of max_e(tokens of expert e) /
mean_e(tokens of expert e): 1 when every expert gets the same share, num_experts / top_k when each token goes
to the same experts. Uniform duplicates (TP ranks that see the same tokens, activation recompute) scale
every count of a layer alike, so the ratio ignores them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RouterLoad:
    """Tokens per expert of every MoE layer, counted while the context is active."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        num_layers: int,
        num_experts: int,
        group: dist.ProcessGroup,
        device: torch.device,
    ):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self.counts_le = torch.zeros(num_layers, num_experts, device=device)  # (layers, experts)
        self.group = group
        self._handles: list = []

    def _count(self, router: torch.nn.Module, args, output) -> None:
        routing_map_te = output[1]  # (tokens, experts) bool: the experts each token goes to
        self.counts_le[router.layer_number - 1] += routing_map_te.sum(0)

    def __enter__(self) -> RouterLoad:
        self._handles = [r.register_forward_hook(self._count) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def metrics(self) -> dict[str, float]:
        """{"moe_load_imbalance": ...} over every layer of the model (collective over `group`)."""
        counts = self.counts_le.clone()
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(counts, group=self.group)
        used = counts.sum(-1) > 0
        if not used.any():
            return {}
        imbalance = counts.max(-1).values / counts.mean(-1)
        return {"moe_load_imbalance": imbalance[used].mean().item()}
