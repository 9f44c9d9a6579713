"""Mixture-of-experts models (engine/models/builder.py, spec.py, moe.py), world size 1 in the pytest process.

megatron's MoELayer as the builder configures it (router scoring, top-k renormalisation, shared expert and
its gate, aux/z losses) against the plain reference of engine/models/moe.py, which the native rollout runs.
Tolerance: float32, 1e-6 absolute on layer outputs.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from engine.config import ModelConfig, MoEConfig
from engine.models.builder import build_gpt_chunks, resolve_shape
from engine.models.moe import grouped_routed_experts, routed_experts, shared_expert
from parallel.dims import ParallelDims

HIDDEN, VOCAB = 32, 40


@pytest.fixture(scope="module")
def groups():
    from parallel.state import destroy_distributed, init_distributed

    saved = dict(os.environ)  # init_distributed exports MASTER_PORT & co: put the environment back
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        get_moe_layer_wise_logging_tracker,
    )

    g = init_distributed(ParallelDims(world_size=1), "cpu", seed=3)
    # megatron's schedules set the aux-loss gradient scale (shape (1,)) before a backward; the backward
    # here runs outside them, so set it the same way. Reset it, and megatron's aux-loss tracker (sized by
    # the first model's layer count), for later tests of this process.
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    yield g
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    get_moe_layer_wise_logging_tracker().clear()
    destroy_distributed()
    os.environ.clear()
    os.environ.update(saved)


def moe_model(groups, dtype=torch.float32, **moe):
    m = ModelConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        max_position_embeddings=64,
        moe=MoEConfig(**{"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16, **moe}),
    )
    shape = dataclasses.replace(resolve_shape(m, VOCAB, 1), dtype=dtype)
    torch.manual_seed(0)
    (model,) = build_gpt_chunks(shape, groups, init_std=0.2, recompute=False)
    return model, shape


ROUTERS = {
    "softmax_renormalised": {},
    "softmax_unnormalised": {"norm_topk_prob": False},
    "softmax_top1": {"top_k": 1, "norm_topk_prob": False},
    "sigmoid": {"score_function": "sigmoid"},
    "shared_gated": {
        "shared_expert_ffn_hidden_size": 24,
        "shared_expert_gate": True,
        "norm_topk_prob": False,
    },
    "shared_ungated": {"shared_expert_ffn_hidden_size": 24},
    "allgather": {"token_dispatcher": "allgather"},
}


@pytest.mark.parametrize("router", list(ROUTERS))
def test_megatron_moe_layer_matches_the_reference(groups, router):
    model, shape = moe_model(groups, **ROUTERS[router])
    mlp = model.decoder.layers[0].mlp
    p = dict(mlp.named_parameters())
    x_sbh = torch.randn(6, 3, HIDDEN, generator=torch.Generator().manual_seed(1))
    out, bias = mlp(x_sbh)
    assert bias is None
    x_th = x_sbh.reshape(-1, HIDDEN)
    experts = range(shape.moe.num_experts)
    want, index = routed_experts(
        x_th,
        p["router.weight"],
        [p[f"experts.local_experts.{e}.linear_fc1.weight"] for e in experts],
        [p[f"experts.local_experts.{e}.linear_fc2.weight"] for e in experts],
        shape.moe,
    )
    if shape.moe.shared_ffn_hidden_size:
        gate = p.get("shared_experts.gate_weight")
        assert (gate is not None) == shape.moe.shared_gate
        want = want + shared_expert(
            x_th, p["shared_experts.linear_fc1.weight"], p["shared_experts.linear_fc2.weight"], gate
        )
    assert len(index.unique()) > 1  # the tokens really spread over experts
    torch.testing.assert_close(out.reshape(-1, HIDDEN), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("router", ["softmax_renormalised", "shared_gated", "sigmoid"])
def test_rollout_experts_round_in_bf16_as_the_training_layer_does(groups, router):
    """bfloat16: the rollout's experts (loop and grouped GEMMs) give megatron's MoE layer output bit for bit.
    megatron scales each expert's activation by the router weight before fc2; scaling fc2's output instead
    (transformers' and vLLM's order) is the same in exact arithmetic but not in bf16: the native rollout's
    log-probs sat 0.29 nat (mean) from the training forward's on a tiny random Qwen2-MoE (CPU)."""
    model, shape = moe_model(groups, torch.bfloat16, **ROUTERS[router])
    mlp = model.decoder.layers[0].mlp
    p = {k: v.detach() for k, v in mlp.named_parameters()}
    x_sbh = torch.randn(6, 3, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        out = mlp(x_sbh)[0].reshape(-1, HIDDEN)
    x_th, experts = x_sbh.reshape(-1, HIDDEN), range(shape.moe.num_experts)
    fc1 = [p[f"experts.local_experts.{e}.linear_fc1.weight"] for e in experts]
    fc2 = [p[f"experts.local_experts.{e}.linear_fc2.weight"] for e in experts]
    loop = routed_experts(x_th, p["router.weight"], fc1, fc2, shape.moe)[0]
    grouped = grouped_routed_experts(x_th, p["router.weight"], torch.stack(fc1), torch.stack(fc2), shape.moe)[
        0
    ]
    if shape.moe.shared_ffn_hidden_size:
        shared = shared_expert(
            x_th,
            p["shared_experts.linear_fc1.weight"],
            p["shared_experts.linear_fc2.weight"],
            p.get("shared_experts.gate_weight"),
        )
        loop, grouped = loop + shared, grouped + shared
    assert out.dtype == torch.bfloat16
    assert torch.equal(loop, out), float((loop - out).abs().max())
    assert torch.equal(grouped, out), float((grouped - out).abs().max())


def test_aux_and_z_losses_reach_the_router_gradient(groups):
    """model.moe.aux_loss_coef / z_loss_coef add megatron's load-balancing and z losses to the backward:
    with the same weights and input, the router's gradient changes and the experts' does not."""
    grads = {}
    for name, coefs in (("none", {}), ("aux", {"aux_loss_coef": 0.5}), ("z", {"z_loss_coef": 0.5})):
        model, _ = moe_model(groups, **coefs)
        mlp = model.decoder.layers[0].mlp
        x = torch.randn(6, 3, HIDDEN, generator=torch.Generator().manual_seed(1))
        mlp(x)[0].sum().backward()
        grads[name] = {k: v.grad.clone() for k, v in mlp.named_parameters()}
    fc1 = "experts.local_experts.0.linear_fc1.weight"
    for name in ("aux", "z"):
        assert not torch.allclose(grads[name]["router.weight"], grads["none"]["router.weight"]), name
        torch.testing.assert_close(grads[name][fc1], grads["none"][fc1])


def test_router_load_counts_the_tokens_each_expert_receives(groups):
    """RouterLoad (the actor's `moe_load_imbalance` metric) counts what the reference router picks: max over
    mean tokens per expert, 1 when balanced, num_experts / top_k when every token picks the same experts."""
    from engine.roles.router_load import RouterLoad

    model, shape = moe_model(groups)
    mlp = model.decoder.layers[0].mlp
    p = dict(mlp.named_parameters())
    x = torch.randn(6, 3, HIDDEN, generator=torch.Generator().manual_seed(1))
    with RouterLoad([model], shape.num_layers, 4, groups.world, groups.device) as load:
        mlp(x)
    mlp(x)  # outside the context: not counted
    experts = range(4)
    _, index = routed_experts(
        x.reshape(-1, HIDDEN),
        p["router.weight"],
        [p[f"experts.local_experts.{e}.linear_fc1.weight"] for e in experts],
        [p[f"experts.local_experts.{e}.linear_fc2.weight"] for e in experts],
        shape.moe,
    )
    counts = torch.bincount(index.flatten(), minlength=4).float()
    assert torch.equal(load.counts_le[0], counts)
    assert load.metrics()["moe_load_imbalance"] == pytest.approx((counts.max() / counts.mean()).item())
    with torch.no_grad():
        p["router.weight"].zero_()
        p["router.weight"][:2] += 1.0  # positive inputs score experts 0 and 1 highest, the others 0
    with RouterLoad([model], shape.num_layers, 4, groups.world, groups.device) as skewed:
        mlp(x.abs())
    assert skewed.metrics()["moe_load_imbalance"] == pytest.approx(4 / 2)


@pytest.mark.parametrize("copies", [1, 2])
def test_router_losses_enter_the_update_as_a_mean_over_micro_batches(groups, copies):
    """Through MegatronRole (the engine's zero-token-count loss convention), the aux and z losses reach the
    router's gradient with their configured coefficients, averaged over the step's micro-batches: the same
    micro-batch once or twice gives the gradient of one plain backward of it (not scaled by its tokens)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from engine.config import OptimConfig
    from engine.roles.policy import MegatronRole

    coefs = {"aux_loss_coef": 0.5, "z_loss_coef": 0.1}
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(8).expand(2, 8)

    model, _ = moe_model(groups, **coefs)  # the reference: one plain backward of the router losses alone
    for module in model.modules():
        if hasattr(module, "calculate_per_token_loss"):
            module.calculate_per_token_loss = False
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    (model(tokens, positions, None).sum() * 0.0).backward()
    want = model.decoder.layers[0].mlp.router.weight.grad.clone()
    assert want.abs().max() > 0

    model, shape = moe_model(groups, **coefs)
    role = MegatronRole([model], groups, shape, OptimConfig(), head="logits")
    mb = {"tokens": tokens, "positions": positions}
    role.run([mb] * copies, lambda logits, mb: (logits.sum() * 0.0, {}), forward_only=False)
    router = role.chunks[0].module.decoder.layers[0].mlp.router.weight
    torch.testing.assert_close(router.main_grad, want, atol=1e-7, rtol=1e-5)
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))  # the schedule left its scale; restore the test's
