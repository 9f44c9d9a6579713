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


def kernels_line(device_type: str, layer_graphs: bool = False, shared_prompts: bool = False) -> str:
    """One line naming the kernels the training forward/backward and the optimizer use on `device_type`,
    whether the layers run from CUDA graphs (`layer_graphs`: engine/validate/run.py `layer_graphs_on`), and
    whether micro-batches hold each group's prompt once (`shared_prompts`: `prompts_shared` there)."""
    te = importlib.util.find_spec("transformer_engine") is not None
    if device_type == "cuda":
        graphs = "from CUDA graphs" if layer_graphs else "eager"
        parts = [
            "attention FlashAttention-2 / cuDNN (torch)",
            "RMSNorm, RoPE and SwiGLU Triton",
            "output head fused and chunked",
            "Adam torch fused",
            f"layers {graphs} (trainer.cuda_graphs)",
        ]
    else:
        parts = ["attention torch SDPA", "RMSNorm torch", "RoPE eager", "output head chunked", "Adam torch"]
    installed = "Transformer Engine installed, not used" if te else "no Transformer Engine"
    layout = "; each group's prompt once per micro-batch (trainer.share_prompts)" if shared_prompts else ""
    return f"kernels: {', '.join(parts)} ({installed}, no Apex: megatron-core's local fallbacks){layout}"


def run_kernels_line(cfg, device_type: str) -> str:
    """`kernels_line` of a run's config `cfg` (TrainConfig): its layers' CUDA graphs and prompt layout as
    resolved (engine/validate/run.py `layer_graphs_on`, `prompts_shared`)."""
    from engine.validate.built import built_model
    from engine.validate.run import layer_graphs_on, prompts_shared

    built = built_model(cfg)
    return kernels_line(device_type, layer_graphs_on(cfg, built), prompts_shared(cfg, built))
