"""engine/roles/offload.py on a stand-in role (a module, a torch Adam behind a megatron-like wrapper), no processes.

CPU: the bytes the role holds on its device drop to 0 while offloaded and come back; values and training
continue bit-identically; views into a shared buffer (how the 3D-HybridEngine and megatron DDP hold
parameters) survive. The trainer-level check (offload_reference + offload_optimizer train bit-identically
to a run without) is in tests/engine/ckpt_runs_script.py. GPU (`gpu` mark): torch.cuda.memory_allocated drops
by the offloaded bytes and comes back.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.roles.offload import PARTS, RoleOffloader, all_onloaded, device_bytes, offloaded


def _role(device: str = "cpu", shared_buffer: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)).to(device)
    if shared_buffer:  # parameters re-pointed into one flat buffer, as the HybridEngine does
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        offset = 0
        for p in model.parameters():
            p.data = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p)  # megatron DDP's grad buffer views
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    return SimpleNamespace(
        chunks=[model],
        optimizer=SimpleNamespace(optimizer=adam),
        groups=SimpleNamespace(device=torch.device(device)),
    )


def _train(role, steps: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    model, adam = role.chunks[0], role.optimizer.optimizer
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen).to(role.groups.device)
        adam.zero_grad()
        model(x).square().mean().backward()
        adam.step()
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


@pytest.mark.parametrize("shared_buffer", [False, True])
def test_round_trip_frees_device_bytes_and_training_continues_bit_identically(shared_buffer):
    role, twin = _role(shared_buffer=shared_buffer), _role(shared_buffer=shared_buffer)
    _train(role, 2, seed=1), _train(twin, 2, seed=1)
    before = {part: device_bytes(role, (part,)) for part in PARTS}
    assert all(before.values()), before
    with offloaded(role) as keeper:
        assert keeper.is_offloaded
        assert device_bytes(role) == 0
        assert role.chunks[0][0].weight.untyped_storage().nbytes() == 0
    assert {part: device_bytes(role, (part,)) for part in PARTS} == before
    assert torch.equal(_train(role, 3, seed=2), _train(twin, 3, seed=2))


def test_offloader_between_phases_and_for_checkpoint_io():
    role, twin = _role(), _role()
    _train(role, 1, seed=1), _train(twin, 1, seed=1)
    params = device_bytes(role, ("params",))
    optim = RoleOffloader(role, ("optimizer",))
    assert optim.offload() == device_bytes(twin, ("optimizer",))  # bytes moved
    assert optim.offload() == 0  # already offloaded: nothing more
    assert device_bytes(role, ("optimizer",)) == 0 and device_bytes(role, ("params",)) == params
    with all_onloaded(role):  # what the checkpoint module does around reads and writes
        assert device_bytes(role, ("optimizer",)) == device_bytes(twin, ("optimizer",))
    assert device_bytes(role, ("optimizer",)) == 0
    for _ in range(2):
        with optim.onloaded():
            got = _train(role, 1, seed=3)
        assert device_bytes(role, ("optimizer",)) == 0
        assert torch.equal(got, _train(twin, 1, seed=3))


def test_disabled_and_absent_roles_are_no_ops_and_unknown_parts_are_named():
    role = _role()
    keeper = RoleOffloader(role, enabled=False)
    assert keeper.offload() == 0 and device_bytes(role) > 0
    assert RoleOffloader(None, ("params",), enabled=True).offload() == 0
    with pytest.raises(ValueError, match="unknown part.*'weights'"):
        RoleOffloader(role, ("weights",))


@pytest.mark.gpu
def test_cuda_memory_allocated_drops_while_offloaded():
    role = _role("cuda")
    _train(role, 1, seed=1)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    moved_bytes = device_bytes(role)
    with offloaded(role):
        during = torch.cuda.memory_allocated()
    after = torch.cuda.memory_allocated()
    assert held - during >= moved_bytes * 0.99, (held, during, moved_bytes)
    assert after == held
