"""The MoE routers' own losses (load-balancing aux loss, z-loss) weighted as megatron intends, under the
engine's loss convention.

megatron means its router losses to enter the gradient as a mean over micro-batches and DP ranks. Under the
engine's convention (`calculate_per_token_loss` with a zero token count, engine/roles/policy.py) the schedule
scales each micro-batch's router losses by the loss scale alone (no 1/micro-batches) and the gradients are
summed over DP (no average), so they would weigh num_micro_batches * dp times their coefficient.
`RouterLossWeights` divides the coefficients, for each optimizer step, by the step's micro-batches times
the DP size, and keeps the routers' own token scaling (which expects megatron to divide every gradient by
the global token count, as the engine does not) switched off. With token-budget micro-batches the DP ranks
may run different numbers of micro-batches; each rank divides by its own count.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class RouterLossWeights:
    """Per-step coefficients of the router losses of one role's chunks (which share `config`)."""

    def __init__(self, chunks: list[torch.nn.Module], config: TransformerConfig):
        from megatron.core.transformer.moe.router import TopKRouter

        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    if module.config is not config:
                        raise ValueError("RouterLossWeights: a router does not read the role's config")
                    module.calculate_per_token_loss = False
        self.config = config
        self.aux_loss_coef = config.moe_aux_loss_coeff
        self.z_loss_coef = config.moe_z_loss_coeff

    def for_step(self, num_micro_batches: int, dp: int) -> None:
        """Set the coefficients for an optimizer step of `num_micro_batches` on each of `dp` ranks."""
        share = num_micro_batches * dp
        self.config.moe_aux_loss_coeff = self.aux_loss_coef / share
        if self.z_loss_coef is not None:
            self.config.moe_z_loss_coeff = self.z_loss_coef / share
