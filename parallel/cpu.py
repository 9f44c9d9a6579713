"""megatron-core on CPU with gloo: every shim the engine needs, in one place, applied only on CPU.

megatron-core 0.16 assumes CUDA in a handful of places (shims 1-5, 7, 8; sequence parallelism needs none, see below).
Each shim below names the megatron code it works around; tests/parallel/test_cpu_shims.py exercises each
one against the real megatron code so that a megatron upgrade that moves the target fails loudly there.
Never import this module's shims on a GPU run: `install_cpu_shims()` refuses when CUDA is in use.

Not shimmed: sequence parallelism needs no shim because the engine's own RMSNorm (engine/models/spec.py)
replaces megatron's WrappedTorchNorm, which asserts `not sequence_parallel`.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_installed = False


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Shim 4: tensors megatron creates with a literal `device="cuda"` land on the CPU instead.

    Targets (0.16.1): pipeline_parallel/schedules.py (`total_num_tokens`), optimizer/optimizer.py,
    optimizer/clip_grads.py, optimizer/grad_scaler.py, distributed/param_and_grad_buffer.py.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _cpu_current_device() -> torch.device:
    """Shim 1: `torch.cuda.current_device()` is used as an allocation device all over megatron."""
    return _CPU


def _install_rng_shims() -> None:
    """Shim 2: megatron's RNG tracker keeps CUDA generator states; keep CPU generator states instead.

    Targets: tensor_parallel/random.py `_get_cuda_rng_state`, `_set_cuda_rng_state`, `CudaRNGStatesTracker.add`.
    Forks then swap the CPU default generator's state, which is what dropout on CPU draws from.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add


_original_tensor_type = torch.Tensor.type


def _tensor_type_reporting_cuda(self, dtype=None, non_blocking=False, **kwargs):
    """Shim 5: megatron asserts `param.type() == 'torch.cuda.FloatTensor'` (optimizer/optimizer.py,
    optimizer/distrib_optimizer.py, optimizer/clip_grads.py); CPU tensors report the CUDA name."""
    if dtype is None and not kwargs:
        name = _original_tensor_type(self)
        if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch.") :]
        return name
    return _original_tensor_type(self, dtype, non_blocking, **kwargs)


class _CpuStream:
    """Shim 7: the one "stream" of a CPU process, for megatron's MoE code that overlaps work on CUDA side
    streams: transformer/moe/token_dispatcher.py (`MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`, its
    `record_event().synchronize()`), transformer/moe/shared_experts.py (the shared-expert overlap stream).
    CPU ops run in order, so waiting and synchronising are no-ops; every stream is this one object, so code
    that checks `current_stream() != side_stream` sees no side stream. A class (not a factory function), so
    that annotations such as `torch.cuda.Stream | None` in other libraries still evaluate."""

    _one: _CpuStream | None = None

    def __new__(cls, *args, **kwargs) -> _CpuStream:
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def wait_stream(self, stream: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: object = None) -> _CpuStream:
        return self  # an "event" whose synchronize() is a no-op

    def query(self) -> bool:
        return True


def _install_stream_shims() -> None:
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _install_split_sizes_shim() -> None:
    """Shim 8: megatron's all-to-all token dispatcher (transformer/moe/token_dispatcher.py,
    `_maybe_dtoh_and_synchronize`) turns its split sizes into host numpy arrays through
    `moe_utils.maybe_move_tensor_to_cpu`, which converts CUDA tensors only; on CPU they stayed tensors, which
    `all_to_all_single` refuses as split sizes. Here a CPU tensor asked for `as_numpy` becomes one too."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move


def install_cpu_shims() -> None:
    """Apply every shim once per process. Call before building megatron models on CPU."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError("install_cpu_shims() called in a process that uses CUDA; the shims are CPU-only")
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = lambda device=None: None  # shim 3: p2p_communication.py synchronizes
    _install_rng_shims()
    torch.Tensor.type = _tensor_type_reporting_cuda
    _install_stream_shims()
    _install_split_sizes_shim()
    _CudaToCpuMode().__enter__()  # active for the rest of the process
    _installed = True


@contextlib.contextmanager
def no_shim_overhead():
    """Run a hot loop of plain torch code without the Python-level device-mapping mode.

    The rollout engine's decode loop issues thousands of small ops; the TorchFunctionMode costs a Python
    call on each. Only code that never creates `device="cuda"` tensors may run inside.
    """
    if not _installed:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield
