"""A quiet start: megatron-core's import-time fallback warnings (Transformer Engine / Apex not installed, a
deprecated CUDA-graph scope default) are replaced by one line saying which kernels run, and ranks other
than the logging rank print errors only.

`quiet_megatron_warnings` runs when the `engine` package is imported, before anything imports megatron.
It hides only those known messages; every other warning still shows on the logging rank.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings

_MEGATRON_FALLBACK_MESSAGES = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
)


def quiet_megatron_warnings() -> None:
    """Hide megatron-core's fallback warnings (the engine does not use the kernels they are about)."""
    for message in _MEGATRON_FALLBACK_MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def errors_only() -> None:
    """On a rank other than the logging one: no warnings, and log records below ERROR dropped."""
    warnings.simplefilter("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("megatron").setLevel(logging.ERROR)


def kernels_line(device_type: str) -> str:
    """One line naming the kernels the training forward/backward and the optimizer use on `device_type`."""
    te = importlib.util.find_spec("transformer_engine") is not None
    if device_type == "cuda":
        parts = [
            "attention torch SDPA (flash / cuDNN)",
            "RMSNorm torch fused",
            "RoPE compiled",
            "output head fused and chunked",
            "Adam torch fused",
        ]
    else:
        parts = ["attention torch SDPA", "RMSNorm torch", "RoPE eager", "output head chunked", "Adam torch"]
    installed = "Transformer Engine installed, not used" if te else "no Transformer Engine"
    return f"kernels: {', '.join(parts)} ({installed}, no Apex: megatron-core's local fallbacks)"
