"""Per-token log-probs and entropy from vocab-parallel logits (each TP rank holds a slice of the vocabulary).

Logits are divided by the rollout temperature first, so the training forward scores tokens under the same
distribution the rollout sampled from. Vocabulary rows added for TP padding get a huge negative logit.
Every reduction runs over the TP group the caller passes (megatron's `vocab_parallel_cross_entropy` reads
its global group, so it is not used here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

MASKED_LOGIT = -1e30  # the logit of vocabulary rows added for TP padding


def mask_padded_vocab(logits_local: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Logits of padded vocabulary rows (ids >= vocab_size) set to a huge negative number."""
    shard = logits_local.shape[-1]
    start = tp_rank * shard
    if start + shard <= vocab_size:
        return logits_local
    col = torch.arange(start, start + shard, device=logits_local.device)
    return logits_local.masked_fill(col >= vocab_size, MASKED_LOGIT)


def _shifted(logits_local: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """Logits minus their (constant, detached) maximum over the full TP-split vocabulary, per position."""
    m = logits_local.detach().max(dim=-1, keepdim=True).values
    if dist.get_world_size(tp_group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    return logits_local - m


def token_log_probs(
    logits_local: torch.Tensor, targets: torch.Tensor, tp_group: dist.ProcessGroup
) -> torch.Tensor:
    """log p(target) for vocab-parallel fp32 logits (..., vocab/tp) and targets (...) of full-vocabulary
    ids; differentiable (each rank's gradient is that of its own vocabulary slice)."""
    shard = logits_local.shape[-1]
    local_t = targets - dist.get_rank(tp_group) * shard
    in_shard = (local_t >= 0) & (local_t < shard)
    shifted = _shifted(logits_local, tp_group)
    z_t = shifted.gather(-1, torch.where(in_shard, local_t, 0)[..., None])[..., 0]
    z_t = reduce_from_tensor_model_parallel_region(torch.where(in_shard, z_t, 0.0), tp_group)
    sum_e = reduce_from_tensor_model_parallel_region(shifted.exp().sum(-1), tp_group)
    return z_t - sum_e.log()


def token_entropy(logits_local: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """Entropy of softmax over the full (TP-split) vocabulary, per position; differentiable."""
    shifted = _shifted(logits_local, tp_group)
    e = shifted.exp()
    sum_e = reduce_from_tensor_model_parallel_region(e.sum(-1), tp_group)
    sum_e_x = reduce_from_tensor_model_parallel_region((e * shifted).sum(-1), tp_group)
    return sum_e.log() - sum_e_x / sum_e
