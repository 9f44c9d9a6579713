"""DAPO's data-side techniques (Yu et al. 2025, arXiv 2503.14476): dynamic sampling, overlong reward shaping.

Clip-higher is `clip_ratio_high` of `losses.ppo_policy_loss` and token-level aggregation is
`loss_agg_mode="token-mean"`; they need nothing here. Nothing here knows about configs or torch.distributed.
"""

import torch
from torch import Tensor


@torch.no_grad()
def dynamic_sampling_keep_mask(scores_b: Tensor, group_index_b: Tensor) -> Tensor:
    """(batch,) bool: False for every response of a group whose scores are all equal (its group-relative
    advantages are all zero, so it carries no gradient); the caller drops those and samples more prompts.

    Groups are given by ids and need not be adjacent. A group of one response is kept (verl does the same:
    with no baseline its advantage is its raw score). Equality is exact, as rule rewards are discrete.
    """
    if not isinstance(scores_b, Tensor) or scores_b.dim() != 1:
        shape = tuple(scores_b.shape) if isinstance(scores_b, Tensor) else type(scores_b).__name__
        raise ValueError(f"scores_b must be a 1-D (batch,) tensor, got {shape}")
    if not isinstance(group_index_b, Tensor) or group_index_b.shape != scores_b.shape:
        shape = (
            tuple(group_index_b.shape) if isinstance(group_index_b, Tensor) else type(group_index_b).__name__
        )
        raise ValueError(
            f"group_index_b has shape {shape} but scores_b has shape {tuple(scores_b.shape)}; "
            "expected one prompt id per response"
        )
    if group_index_b.dtype.is_floating_point or group_index_b.dtype == torch.bool:
        raise ValueError(
            f"group_index_b must be an integer tensor of prompt ids, got dtype {group_index_b.dtype}"
        )
    group_ids_g, inverse_b = torch.unique(group_index_b, return_inverse=True)
    num_groups = group_ids_g.numel()
    max_g = torch.full((num_groups,), -torch.inf, dtype=scores_b.dtype, device=scores_b.device)
    min_g = torch.full((num_groups,), torch.inf, dtype=scores_b.dtype, device=scores_b.device)
    max_g = max_g.scatter_reduce(0, inverse_b, scores_b, reduce="amax")
    min_g = min_g.scatter_reduce(0, inverse_b, scores_b, reduce="amin")
    count_g = torch.bincount(inverse_b, minlength=num_groups)
    keep_g = (max_g > min_g) | (count_g == 1)
    return keep_g[inverse_b]


def overlong_penalty(
    response_lengths_b: Tensor, *, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> Tensor:
    """Soft overlong punishment (DAPO eq. 13), to ADD to the scores: (batch,), <= 0.

    0 up to max_len - buffer_len tokens, then falling linearly to -penalty_factor at max_len (and staying
    there beyond it). buffer_len 0 turns it off (all zeros). response_lengths_b counts generated tokens.
    """
    if not isinstance(response_lengths_b, Tensor) or response_lengths_b.dim() != 1:
        shape = tuple(response_lengths_b.shape) if isinstance(response_lengths_b, Tensor) else "not a tensor"
        raise ValueError(f"response_lengths_b must be a 1-D (batch,) tensor, got {shape}")
    if buffer_len < 0 or buffer_len > max_len:
        raise ValueError(
            f"overlong_buffer_len={buffer_len!r} must be in [0, max_len={max_len!r}]; lower it or raise the "
            "rollout's max new tokens"
        )
    dtype = (
        torch.get_default_dtype()
        if not response_lengths_b.dtype.is_floating_point
        else response_lengths_b.dtype
    )
    if buffer_len == 0:
        return torch.zeros(response_lengths_b.shape, dtype=dtype, device=response_lengths_b.device)
    exceed_b = (response_lengths_b.to(dtype) - (max_len - buffer_len)).clamp(0, buffer_len)
    return -exceed_b / buffer_len * penalty_factor
