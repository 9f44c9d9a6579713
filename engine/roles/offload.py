"""Move a model role's device memory to host memory around the phases that do not need it, and back.

    with offloaded(role, what=("params", "grads", "optimizer")):   # off on enter, back on exit
        ...
    keeper = RoleOffloader(role, ("optimizer",))                    # off between phases, back for one
    keeper.offload()
    with keeper.onloaded():
        role.optimizer_step()

`what` picks parts of a `MegatronRole`: `params` (the storage behind the parameters), `grads` (megatron DDP's
grad buffers behind `main_grad`), `optimizer` (Adam moments and the fp32 main parameters of mixed precision;
whatever the optimizer shares with the model's parameters or grads counts as those, not as optimizer state).

How: for each distinct storage of those tensors on the role's device, its bytes are copied to a host buffer
(pinned when the device is a GPU) and the storage is resized to 0 bytes; bringing it back resizes the storage
and copies the bytes in. Tensors are never re-pointed, so every view stays valid: parameters living in the
3D-HybridEngine's buffer or in megatron DDP's param/grad buffers, `main_grad`, the optimizer's references.
Values are bit-identical after a round trip. On a CPU "device" the same code runs (bytes copied, storage
freed) without saving memory: the CPU tests exercise the path, GPU runs get the savings.

Must not: be entered while the role is in use (the storages are empty while offloaded), or offload the
actor's parameters across a weight transition. On a GPU the bytes come back at a new address, so nothing
may hold raw pointers into offloaded storages (CUDA graphs, IPC handles given to a rollout engine). The checkpoint module brings offloaded parts back while
it reads or writes a role (`all_onloaded`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

PARTS = ("params", "grads", "optimizer")

# id(role) -> the offloaders holding some of its storages offloaded right now (for `all_onloaded`); an
# offloader references its role, so an id here cannot be reused while its entry exists
_ACTIVE: dict[int, set] = {}


def _storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, torch.UntypedStorage]:
    out = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        if s.nbytes():
            out.setdefault(s.data_ptr(), s)
    return out


def _sub_optimizers(role) -> list:
    opt = role.optimizer
    if opt is None:
        return []
    return list(getattr(opt, "chained_optimizers", [opt]))


def _optimizer_tensors(role) -> Iterator[torch.Tensor]:
    for sub in _sub_optimizers(role):
        inner = sub.optimizer  # the torch optimizer megatron wraps
        for group in inner.param_groups:
            yield from group["params"]  # fp32 main params (mixed precision), else the model's own
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def role_storages(role, what: Iterable[str]) -> list[torch.UntypedStorage]:
    """The distinct, non-empty storages on the role's device behind the parts `what` of `role`."""
    what = set(what)
    unknown = what - set(PARTS)
    if unknown:
        raise ValueError(f"offload: unknown part(s) {sorted(unknown)}; choose from {PARTS}")
    params = [p for c in role.chunks for p in c.parameters()]
    parts = {
        "params": _storages(params),
        "grads": _storages([getattr(p, "main_grad", None) for p in params] + [p.grad for p in params]),
    }
    shared = parts["params"].keys() | parts["grads"].keys()
    parts["optimizer"] = {k: s for k, s in _storages(_optimizer_tensors(role)).items() if k not in shared}
    device = role.groups.device
    chosen: dict[int, torch.UntypedStorage] = {}
    for part in PARTS:
        if part in what:
            chosen.update(parts[part])
    return [s for s in chosen.values() if s.device.type == device.type]


def device_bytes(role, what: Iterable[str] = PARTS) -> int:
    """Bytes the parts `what` of `role` hold on its device now (0 for what is offloaded)."""
    return sum(s.nbytes() for s in role_storages(role, what))


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RoleOffloader:
    """Keeps the parts `what` of one role in host memory between phases. Disabled (`enabled=False`), every
    call is a no-op, so callers need no `if offload:` branches."""

    def __init__(self, role, what: Iterable[str] = PARTS, enabled: bool = True):
        self.role, self.what, self.enabled = role, tuple(what), enabled and role is not None
        if self.enabled:
            role_storages(role, self.what)  # validates `what`
        self._moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def is_offloaded(self) -> bool:
        return bool(self._moved)

    def offload(self) -> int:
        """Move the parts to host memory (storages found now: optimizer state appears after the first
        step); returns the bytes moved. A second call while offloaded moves nothing."""
        if not self.enabled or self._moved:
            return 0
        device = self.role.groups.device
        for storage in role_storages(self.role, self.what):
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=device.type == "cuda")
            host.copy_(_bytes_view(storage), non_blocking=True)
            self._moved.append((storage, host))
        _sync(device)  # the copies must land before the device memory is released
        for storage, _ in self._moved:
            storage.resize_(0)
        if self._moved:
            _ACTIVE.setdefault(id(self.role), set()).add(self)
        return sum(h.numel() for _, h in self._moved)

    def onload(self) -> int:
        """Bring the parts back to the device, bit-identical; returns the bytes moved."""
        if not self._moved:
            return 0
        for storage, host in self._moved:
            storage.resize_(host.numel())
            _bytes_view(storage).copy_(host, non_blocking=True)
        _sync(self.role.groups.device)  # the host buffers are dropped below
        moved = sum(h.numel() for _, h in self._moved)
        self._moved = []
        active = _ACTIVE.get(id(self.role), set())
        active.discard(self)
        if not active:
            _ACTIVE.pop(id(self.role), None)
        return moved

    @contextlib.contextmanager
    def onloaded(self):
        """On the device for the body, offloaded again after it (if enabled)."""
        self.onload()
        try:
            yield
        finally:
            self.offload()


@contextlib.contextmanager
def offloaded(role, what: Iterable[str] = PARTS, enabled: bool = True):
    """The parts `what` of `role` in host memory for the body, back on the device after it."""
    keeper = RoleOffloader(role, what, enabled)
    keeper.offload()
    try:
        yield keeper
    finally:
        keeper.onload()


@contextlib.contextmanager
def all_onloaded(role):
    """Everything of `role` that any offloader holds in host memory back on the device for the body (for
    checkpoint reads and writes), offloaded again after it."""
    active = list(_ACTIVE.get(id(role), ()))
    for keeper in active:
        keeper.onload()
    try:
        yield
    finally:
        for keeper in active:
            keeper.offload()
