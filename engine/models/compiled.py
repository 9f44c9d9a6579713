"""torch.compile'd elementwise kernels for CUDA tensors, eager everywhere else.

Small op chains (a norm, a gated activation, the rotary embedding, a softmax statistic) run as one fused
Triton kernel on CUDA instead of one kernel per op; the same Python function runs eagerly on CPU, where
torch.compile would need a C++ toolchain and buys little. Each use site names an environment switch
(`ENGINE_COMPILE_LOGPROBS`, `ENGINE_COMPILE_ROLLOUT`, `ENGINE_COMPILE_ATTENTION`) that turns its kernels off when set to 0, for
benchmarks' baselines and for debugging a suspected compiler problem.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable

import torch

LOGPROBS = "ENGINE_COMPILE_LOGPROBS"
"""Switch of the fused output head's kernels (engine/models/fused_logprobs.py)."""
ROLLOUT = "ENGINE_COMPILE_ROLLOUT"
"""Switch of the native rollout engine's kernels (engine/rollout/model.py, engine/rollout/sampler.py)."""
ATTENTION = "ENGINE_COMPILE_ATTENTION"
"""Switch of the split shared-prompt attention's merge (engine/models/shared_prompt_split.py)."""

_compiled: dict[tuple[str, str], Callable] = {}


def switched_on(switch: str) -> bool:
    """The use site's kernels are on: its environment variable `switch` is not "0"."""
    return os.environ.get(switch, "1") != "0"


def cuda_kernel(
    fn: Callable, device: torch.device, switch: str, dynamic: bool | None = True, key: Hashable | None = None
) -> Callable:
    """`fn` compiled (built once per function) when `device` is CUDA and the environment variable `switch` is
    not "0"; `fn` itself otherwise. `dynamic`: torch.compile's; True treats every size as symbolic (one
    compile), None specialises first and makes only the sizes seen to change symbolic on a recompile
    (sizes that never change, like a head dim or a hidden size, stay constants: no integer division by a
    runtime value in index math, e.g. of a roll or a chunk). `key`: what the compiled function is cached
    under; default the function's module and qualified name, which the bound methods of one class share."""
    if device.type != "cuda" or not switched_on(switch):
        return fn
    key = (fn.__module__, fn.__qualname__) if key is None else key
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=dynamic)
    return _compiled[key]
