"""Shared helpers for the algorithm files: name registries, input checks, masked statistics.

Private to `algorithms/`. Nothing here knows about configs or torch.distributed. Masked statistics use
`torch.where` rather than multiplying by the mask, so padded positions can hold any value (even inf)
without leaking into results or gradients.
"""

from collections.abc import Callable
from typing import Generic, TypeVar

import torch
from torch import Tensor

FnT = TypeVar("FnT", bound=Callable)


class Registry(Generic[FnT]):
    """Functions keyed by name; unknown names raise a ValueError that lists the known ones."""

    def __init__(self, what: str, arg_name: str):
        self.what = what  # e.g. "advantage estimator", used in error messages
        self.arg_name = arg_name  # the config key / argument users set, e.g. "adv_estimator"
        self._fns: dict[str, FnT] = {}

    def register(self, name: str) -> Callable[[FnT], FnT]:
        def decorator(fn: FnT) -> FnT:
            if name in self._fns:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> FnT:
        if name not in self._fns:
            raise ValueError(
                f"{self.arg_name}={name!r} is not a known {self.what}; known names: {', '.join(self.names())}"
            )
        return self._fns[name]

    def names(self) -> list[str]:
        return sorted(self._fns)


def check_mask(mask_bt: Tensor, arg_name: str = "mask_bt") -> Tensor:
    """Return the (batch, resp_len) mask as bool; raise ValueError unless it is 2-D."""
    if not isinstance(mask_bt, Tensor) or mask_bt.dim() != 2:
        shape = tuple(mask_bt.shape) if isinstance(mask_bt, Tensor) else type(mask_bt).__name__
        raise ValueError(f"{arg_name} must be a 2-D (batch, resp_len) tensor, got {shape}")
    return mask_bt if mask_bt.dtype == torch.bool else mask_bt != 0


def check_like_mask(tensor: Tensor | None, arg_name: str, mask_bt: Tensor) -> Tensor:
    """Raise ValueError unless `tensor` is a tensor with exactly the mask's (batch, resp_len) shape."""
    if tensor is None:
        raise ValueError(f"{arg_name} is required here but was None")
    if not isinstance(tensor, Tensor) or tensor.shape != mask_bt.shape:
        shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
        raise ValueError(
            f"{arg_name} has shape {shape} but mask_bt has shape {tuple(mask_bt.shape)}; "
            "they must match (batch, resp_len)"
        )
    return tensor


def check_per_sequence(tensor: Tensor | None, arg_name: str, mask_bt: Tensor) -> Tensor:
    """Raise ValueError unless `tensor` is a 1-D tensor with one entry per row of the mask."""
    if tensor is None:
        raise ValueError(f"{arg_name} is required here but was None")
    if not isinstance(tensor, Tensor) or tensor.shape != mask_bt.shape[:1]:
        shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
        raise ValueError(
            f"{arg_name} has shape {shape} but mask_bt has shape {tuple(mask_bt.shape)}; "
            f"expected ({mask_bt.shape[0]},) = (batch,)"
        )
    return tensor


def check_group_index(group_index_b: Tensor | None, mask_bt: Tensor) -> Tensor:
    """Raise ValueError unless group_index_b is an integer (batch,) tensor of prompt ids."""
    group_index_b = check_per_sequence(group_index_b, "group_index_b", mask_bt)
    if (
        group_index_b.dtype.is_floating_point
        or group_index_b.dtype.is_complex
        or group_index_b.dtype == torch.bool
    ):
        raise ValueError(
            f"group_index_b must be an integer tensor of prompt ids, got dtype {group_index_b.dtype}"
        )
    return group_index_b


def masked_sum(x_bt: Tensor, mask_bt: Tensor, dim: int | None = None) -> Tensor:
    zeros = torch.zeros((), dtype=x_bt.dtype, device=x_bt.device)
    masked = torch.where(mask_bt, x_bt, zeros)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """Mean over valid positions; 0 when there are none (a shard can be all padding)."""
    return masked_sum(x_bt, mask_bt) / mask_bt.sum().clamp(min=1)


def local_sum(x: Tensor) -> Tensor:
    """The `reduce_sum` of a call that holds the whole batch: the tensor itself."""
    return x


def masked_whiten(
    x_bt: Tensor, mask_bt: Tensor, eps: float = 1e-8, reduce_sum: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """(x - mean) / sqrt(var + eps) over valid positions of the whole batch, zero on padding.

    verl's `masked_whiten`: masked mean, unbiased (Bessel-corrected) variance sum((x - mean)^2) / (N - 1),
    eps 1e-8 inside the square root; needs at least two valid tokens. When the batch is sharded (DP),
    `reduce_sum` sums a tensor over all shards (every shard calls it twice, in the same order); None = this
    call holds the whole batch. The moments are float64, so the result does not depend on the split beyond
    the rounding of x's dtype.
    """
    reduce_sum = reduce_sum or local_sum
    x64_bt = x_bt.double()
    count_sum = reduce_sum(torch.stack([mask_bt.sum().double(), masked_sum(x64_bt, mask_bt)]))
    num_valid = count_sum[0]
    mean = count_sum[1] / num_valid.clamp(min=1)
    centered_bt = torch.where(
        mask_bt, x64_bt - mean, torch.zeros((), dtype=torch.float64, device=x_bt.device)
    )
    var = reduce_sum(centered_bt.square().sum().reshape(1))[0] / (num_valid - 1).clamp(min=1)
    return (centered_bt * torch.rsqrt(var + eps)).to(x_bt.dtype)


def broadcast_to_tokens(x_b: Tensor, mask_bt: Tensor) -> Tensor:
    """(batch,) -> (batch, resp_len): the value on every valid token, zero on padding."""
    return torch.where(mask_bt, x_b.unsqueeze(-1), torch.zeros((), dtype=x_b.dtype, device=x_b.device))
