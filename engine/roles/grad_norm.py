"""megatron's gradient norm and gradient scaling without apex or Transformer Engine, as torch's foreach kernels.

Without apex or TE (never installed here) megatron-core 0.16 (optimizer/clip_grads.py, optimizer/optimizer.py)
falls back to megatron/core/utils.py's `local_multi_tensor_l2_norm`, which takes `torch.norm` of each
gradient and builds a host tensor of the results: one device-to-host copy, so one synchronisation, per
gradient tensor (198 per optimizer step at Qwen2.5-1.5B: scripts/bench/README.md, `sync_sites.py`), and to
`local_multi_tensor_scale`, which writes `dst.copy_(src * scale)`: two kernels and a temporary per tensor
(clipping the gradients; copying the float32 main parameters into the bf16 model's after every step, at
scale 1). `install_foreach_grad_ops` swaps them for:
- `foreach_l2_norm`: the per-tensor norms in one `_foreach_norm` (float32), their norm on the device; megatron
  still reads the total once (`.item()`, which the clip coefficient needs);
- `foreach_scale`: `_foreach_mul_` where source and destination are the same tensors (clipping), else one
  `_foreach_copy_` (scale 1) or `_foreach_mul` then `_foreach_copy_`.
Values: the norm equal to megatron's up to float32 summation order, the scaled tensors bitwise equal
(tests/engine/test_grad_norm.py runs both through megatron's own `get_grad_norm_fp32` and
`clip_grad_by_total_norm_fp32`). Installed only where megatron took its fallback.
"""

from __future__ import annotations

import torch


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron's `local_multi_tensor_l2_norm` (per_tensor=False, what megatron asks): the L2 norm
    of every tensor of `tensor_lists[0]` together, as a float32 tensor of shape (1,) on their device."""
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for megatron's `local_multi_tensor_scale`: `dst = src * scale` for each pair."""
    src, dst = tensor_lists
    if not dst:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def install_foreach_grad_ops() -> None:
    """Point megatron's clip_grads and optimizer modules at the foreach versions where they hold megatron's
    local fallbacks (with apex or TE installed their fused kernels stay)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
