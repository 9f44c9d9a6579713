"""Rollout engines behind one interface (engine/rollout/base.py): `native` (engine/rollout/native.py, always
available) and `vllm` (engine/rollout/vllm_backend.py, optional). `build_rollout_engine` picks one from
`rollout.backend`; vLLM is imported only when asked for."""

from __future__ import annotations

import torch

from engine.models.builder import ModelShape
from engine.rollout.base import RolloutEngine


def starts_on_every_rank(backend: str) -> bool:
    """Whether starting `backend`'s engine is a collective over every rank of the job: vLLM's external launcher
    builds its process groups over the whole torch.distributed world and takes the minimum of free memory over
    it, so under split placement the training ranks start one too (engine/split/run.py) and leave it asleep."""
    return backend == "vllm"


def build_rollout_engine(
    rollout_cfg, shape: ModelShape, device: torch.device, pad_id: int, *, model_dir: str = "", seed: int = 0
) -> RolloutEngine:
    """The engine `rollout_cfg.backend` names (`rollout_cfg`: engine.config.RolloutConfig). `model_dir`: the HF
    checkpoint directory (model.path) whose config.json vLLM builds from; empty: one written from `shape`."""
    r = rollout_cfg
    if r.backend == "native":
        from engine.rollout.native import NativeRollout

        return NativeRollout(
            shape,
            device,
            r.max_num_seqs,
            pad_id,
            # true (the default): graphs where the decode step has no host sync (moe_experts.use_cuda_graphs)
            cuda_graphs=None if r.cuda_graphs or device.type != "cuda" else False,
            kv_cache_memory_fraction=r.kv_cache_memory_fraction,
        )
    if r.backend == "vllm":
        from engine.rollout.vllm_backend import VllmRollout, full_log_probs_mode

        return VllmRollout(
            shape,
            device,
            r.tp,
            pad_id,
            max_num_seqs=r.max_num_seqs,
            gpu_memory_utilization=r.gpu_memory_utilization,
            seed=seed,
            model_dir=model_dir or None,
            enforce_eager=not r.cuda_graphs,
            # None (truncation at T != 1): engine/validate/ allows it only with rollout.log_probs=false
            logprobs_mode=full_log_probs_mode(r.temperature, r.top_p, r.top_k) or "processed_logprobs",
        )
    raise ValueError(f"rollout.backend={r.backend!r} is not one of native, vllm")
