"""megatron's gradient norm and scaling through the foreach kernels (engine/roles/grad_norm.py), against
megatron's own fallbacks (megatron/core/utils.py) run through megatron's `get_grad_norm_fp32` and
`clip_grad_by_total_norm_fp32`: the norm within float32 summation order (1e-6 relative), every scaled
tensor bitwise equal."""

from __future__ import annotations

import pytest
import torch

from engine.roles import grad_norm


@pytest.fixture
def megatron_fallbacks():
    """megatron's clip_grads and optimizer modules as megatron left them; restored after the test."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    saved = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, optimizer.multi_tensor_scale_impl)
    clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = optimizer.multi_tensor_scale_impl = utils.local_multi_tensor_scale
    yield clip_grads, optimizer
    clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, optimizer.multi_tensor_scale_impl = saved


def _grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3,), (17, 5), (64, 33), (1,), (128,), (7, 7, 3)]
    return [
        torch.randn(s, generator=gen) * 10 ** float(torch.randint(-3, 3, (1,), generator=gen)) for s in shapes
    ]


def test_the_norm_equals_megatrons_fallback(groups, megatron_fallbacks):
    clip_grads, _ = megatron_fallbacks
    grads = _grads(0)
    want = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=groups.world)
    grad_norm.install_foreach_grad_ops()
    assert clip_grads.l2_norm_impl is grad_norm.foreach_l2_norm
    got = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=groups.world)
    exact = float(torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads])))
    assert got == pytest.approx(want, rel=1e-6) and got == pytest.approx(exact, rel=1e-6)
    assert clip_grads.get_grad_norm_fp32([], grad_stats_parallel_group=groups.world) == 0.0


def test_clipping_and_the_parameter_copy_are_bitwise_megatrons(groups, megatron_fallbacks):
    from megatron.core import utils

    clip_grads, optimizer = megatron_fallbacks
    results = []
    for install in (False, True):
        if install:
            grad_norm.install_foreach_grad_ops()
        params = [torch.nn.Parameter(g.clone()) for g in _grads(1)]
        for p, g in zip(params, _grads(2)):
            p.grad = g
        clip_grads.clip_grad_by_total_norm_fp32(params, 1.0, 50.0)  # clip coefficient 1/50, in place
        model = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]  # main -> model, scale 1
        optimizer._multi_tensor_copy_this_to_that([p.detach() for p in params], model, torch.zeros(1))
        results.append(([p.grad for p in params], model))
    for before, after in zip(*results):
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert not torch.equal(results[1][0][0], _grads(2)[0])  # the gradients were clipped
    src = _grads(3)  # another scale into other tensors of another dtype
    want, got = ([torch.empty_like(g, dtype=torch.bfloat16) for g in src] for _ in range(2))
    utils.local_multi_tensor_scale(0, None, [src, want], 0.37)
    grad_norm.foreach_scale(0, None, [src, got], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_installed_only_over_megatrons_fallbacks(megatron_fallbacks):
    clip_grads, optimizer = megatron_fallbacks
    fused = object()  # as apex's or TE's kernel would be
    clip_grads.l2_norm_impl = optimizer.multi_tensor_scale_impl = fused
    grad_norm.install_foreach_grad_ops()
    assert clip_grads.l2_norm_impl is fused and optimizer.multi_tensor_scale_impl is fused
    assert clip_grads.multi_tensor_scale_impl is grad_norm.foreach_scale
