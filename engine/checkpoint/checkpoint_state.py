"""What one rank's checkpoint holds and how it goes back into the live objects: a trainable role's parameters
(by global name), optimizer state and LR schedule; the random generators. engine/checkpoint/checkpoint.py decides when
and where this is written and read.

Parameters are loaded by copying INTO the existing tensors, never by replacing them: the 3D-HybridEngine
re-points parameters into its own buffer, megatron DDP and the distributed optimizer hold views of them.
Two megatron-core 0.16 quirks are handled here (see `_mark_unpadded`, `_unshare_state`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from engine.errors import CheckpointError
from engine.roles.policy import MegatronRole, sub_optimizers, torch_optimizers, use_fused_adam
from parallel.rollout_weights import global_param_names
from parallel.state import ProcessGroups


def cpu_copy(obj: Any) -> Any:
    """`obj` with every tensor copied to host memory (nested dicts, lists, tuples); the copy owns its bytes,
    so it neither aliases the live state nor drags a whole shared buffer into the file."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def layer_ranges(groups: ProcessGroups, num_layers: int) -> list[range]:
    """Global layer indices of this rank's chunks (one range per virtual stage)."""
    return groups.dims.train_layout().layers(groups.pp_rank, num_layers)


def _layer_ranges(role: MegatronRole) -> list[range]:
    return layer_ranges(role.groups, role.shape.num_layers)


def _is_distributed(sub) -> bool:
    return hasattr(sub, "get_parameter_state_dp_reshardable")


def role_state_dict(role: MegatronRole) -> dict[str, Any]:
    """A trainable role's state on this rank: parameters by global name, optimizer, LR schedule (host copies).

    Optimizer: megatron's `state_dict()` per sub-optimizer; the distributed optimizer keeps the parameter
    state (fp32 main shard, Adam moments) outside it, so its per-rank shard is added from
    `get_parameter_state_dp_reshardable()` (no communication; the layout check guarantees the same shards).
    """
    model = global_param_names(role.chunks, _layer_ranges(role))
    optimizers = []
    for sub in sub_optimizers(role.optimizer):
        entry = {"common": sub.state_dict()}
        if _is_distributed(sub):
            entry["param_state"] = sub.get_parameter_state_dp_reshardable()
        optimizers.append(entry)
    return cpu_copy({"model": model, "optimizer": optimizers, "scheduler": role.scheduler.state_dict()})


@torch.no_grad()
def load_params(params: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor], where: str) -> None:
    """Copy saved tensors (global name -> tensor) INTO the live parameters: in place (`copy_`), never
    replaced, because the 3D-HybridEngine and megatron's buffers hold views of them."""
    if params.keys() != saved.keys():
        missing, extra = sorted(params.keys() - saved.keys()), sorted(saved.keys() - params.keys())
        raise CheckpointError(
            f"{where}: parameter names differ from this model's (missing {missing[:5]}, unexpected "
            f"{extra[:5]}); Fix: resume with the model settings of the run that saved it"
        )
    for name, param in params.items():
        src = saved[name]
        if src.shape != param.shape or src.dtype != param.dtype:
            raise CheckpointError(
                f"{where}: {name} is {tuple(src.shape)} {src.dtype} in the checkpoint but "
                f"{tuple(param.shape)} {param.dtype} in this model; Fix: resume with the same model.*"
            )
        param.data.copy_(src)


def _mark_unpadded(param_state: dict) -> dict:
    """megatron 0.16's `get_parameter_state_dp_reshardable` omits the `padding` flag that its inverse
    `load_parameter_state_from_dp_reshardable` filters on; every entry it returns is a real parameter."""
    for key, by_dtype in param_state.items():
        if isinstance(key, int):  # buffer index -> {dtype: [bucket: [per-parameter dict]]}
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry.setdefault("padding", False)
    return param_state


def _unshare_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its own state tensors. megatron 0.16's DistributedOptimizer.load_state_dict (torch
    Adam, no Apex/TE) sets ONE `step` tensor for all parameters; torch's foreach Adam then increments it once
    per parameter per step, and the bias correction drifts from the uninterrupted run's."""
    seen: set[int] = set()
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if id(value) in seen:
                    state[key] = value.clone()
                seen.add(id(value))


def _hyperparameters(role: MegatronRole) -> list[list[dict[str, Any]]]:
    """Every setting of the role's torch param groups (betas, eps, max_lr/min_lr, wd_mult, ...), per optimizer."""
    return [
        [{k: v for k, v in group.items() if k != "params"} for group in inner.param_groups]
        for inner in torch_optimizers(role.optimizer)
    ]


@torch.no_grad()
def load_role_state(
    role: MegatronRole, state: Mapping[str, Any], where: str, schedule_scale: tuple[int, int] = (1, 1)
) -> None:
    """Load a saved role state into the live role (parameters in place, see `load_params`), then its
    optimizer state and the position in the LR schedule: the saved count of optimizer steps x now / before
    of `schedule_scale` (optimizer steps per RL step now and in the saved run: a resume that changes
    ppo_epochs or num_mini_batches lands where a fresh run of its config would be after the same RL steps).

    The current config decides every hyperparameter: megatron's and torch's `load_state_dict` restore the
    saved param groups (betas, eps, weight decay, max/min lr), so the groups' settings as built from the
    config are put back after it, and the schedule (built from the config) is only moved to the saved
    count of applied optimizer steps. From the checkpoint come the parameters, Adam's moments and step
    counters, fp32 main parameters and the float16 loss scaler's state."""
    load_params(global_param_names(role.chunks, _layer_ranges(role)), state["model"], where)
    built = _hyperparameters(role)
    subs = sub_optimizers(role.optimizer)
    if len(subs) != len(state["optimizer"]):
        raise CheckpointError(
            f"{where}: {len(state['optimizer'])} optimizer states for {len(subs)} optimizers"
        )
    for sub, entry in zip(subs, state["optimizer"]):
        sub.load_state_dict(entry["common"])
        if _is_distributed(sub):
            sub.load_parameter_state_from_dp_reshardable(_mark_unpadded(entry["param_state"]))
        _unshare_state(sub.optimizer)
    for inner, groups in zip(torch_optimizers(role.optimizer), built):
        for group, settings in zip(inner.param_groups, groups):
            group.update(settings)
    if role.groups.device.type == "cuda":
        use_fused_adam(role.optimizer)
    role.scheduler.num_steps = 0
    now, before = schedule_scale
    position = int(state["scheduler"]["num_steps"]) * now // before
    role.scheduler.step(increment=position)  # sets lr and weight decay


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every random generator a step might draw from: Python, NumPy, torch (CPU and this rank's GPU), and
    megatron's model-parallel RNG tracker."""
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return cpu_copy(state)


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
