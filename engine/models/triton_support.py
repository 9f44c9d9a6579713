"""Triton, where it is installed, and where the engine's Triton kernels can run.

One import guard for the kernel modules (engine/models/triton_logprobs.py, triton_swiglu.py,
engine/rollout/triton_decode.py, triton_rope_kv.py): `triton` and `tl` are None on CPU-only torch builds, which
ship no Triton, and each module defines its kernels under `if triton is not None`. Besides CUDA, the kernels run
on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, read when the kernels are defined): the CPU
tests' way to run them (tests/engine/test_triton_cpu.py), in float16 only (the interpreter has no bfloat16).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = tl = None


def interpreted(device: torch.device) -> bool:
    """Triton's interpreter runs the kernels on `device`'s tensors (a CPU device, TRITON_INTERPRET=1)."""
    return triton is not None and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def elementwise_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """A kernel without tensor-core dots runs here: CUDA with Triton (any float dtype), or float16 under the
    interpreter."""
    if triton is None:
        return False
    return device.type == "cuda" or (interpreted(device) and dtype == torch.float16)


def dot_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """A kernel with tensor-core dots (`tl.dot`) runs here: CUDA sm80+ in half precision (float32 would run
    `tl.dot` in TF32), or float16 under the interpreter."""
    if triton is None:
        return False
    if device.type == "cuda":
        return dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(device) >= (8, 0)
    return interpreted(device) and dtype == torch.float16


INTERPRETED_SMS = 4
"""The multiprocessors the kernels' launch heuristics assume under the interpreter: a few, so that small CPU tests
exercise the same splits and loops as the GPU."""


def sm_count(device: torch.device) -> int:
    """The multiprocessors of a CUDA `device` (cached per device), or `INTERPRETED_SMS` elsewhere."""
    if device.type != "cuda":
        return INTERPRETED_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
