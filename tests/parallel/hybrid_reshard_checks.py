"""Checks of the colocated 3D-HybridEngine for tests/parallel/hybrid_reshard_script.py (under torchrun,
gloo): the tiny GPTModel they build, a reshard round trip against NaiveGather's full weights and HybridFlow's
byte formula, a training step after a round trip, parameters re-pointed after the build, invalid rollout
layouts, and the experts at EP=2 (ExpertGather). Each raises AssertionError on a mismatch and returns figures
for the summary.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
import weakref

import torch
import torch.distributed as dist

from engine.config import ModelConfig, MoEConfig, OptimConfig
from engine.models.builder import build_gpt_chunks, build_gpt_chunks_layout_invariant, resolve_shape
from engine.models.logprobs import token_log_probs
from engine.roles.policy import MegatronRole
from parallel.dims import ParallelDims
from parallel.expert_gather import ExpertGather
from parallel.hybrid_check import hybridflow_bytes, layer_param_specs, verify_rollout
from parallel.hybrid_engine import HybridEngine
from parallel.layout import PartitionKind
from parallel.naive_gather import NaiveGather
from parallel.rollout_weights import global_param_names, is_expert_param
from parallel.state import destroy_model_parallel_groups, init_distributed

NUM_LAYERS = 8
VOCAB = 96


def model_config(tie: bool, num_layers: int = NUM_LAYERS, qk_norm: bool = True) -> ModelConfig:
    return ModelConfig(
        num_layers=num_layers,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=VOCAB,
        qkv_bias=True,
        qk_norm=qk_norm,
        tie_embeddings=tie,
    )


def setup(tp: int, pp: int, vpp: int = 1):
    destroy_model_parallel_groups()
    dims = ParallelDims(world_size=int(os.environ["WORLD_SIZE"]), tp=tp, pp=pp, vpp=vpp)
    return init_distributed(dims, "cpu")


def build(groups, tie: bool, seed: int = 0, num_layers: int = NUM_LAYERS):
    shape = resolve_shape(model_config(tie, num_layers), VOCAB, groups.dims.tp)
    torch.manual_seed(seed)
    chunks = build_gpt_chunks(shape, groups, init_std=0.02, recompute=False)
    return shape, chunks


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def snapshot(chunks) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def check_bytes(
    engine: HybridEngine, full: dict[str, torch.Tensor], rank: int, num_layers: int = NUM_LAYERS
) -> dict[str, int]:
    """Measured bytes == plan == HybridLayout.received_bytes == HybridFlow's formula (sharded layer part;
    the formula assumes stages of equal size, so uneven stages check the first three only)."""
    layout, stats, cat = engine.layout, engine.last_stats, engine.plan.received_by_category
    expect(stats["received_bytes"] == sum(cat.values()), f"measured {stats['received_bytes']} != plan {cat}")
    specs = layer_param_specs(full, layout, num_layers)
    expected_layers = layout.received_bytes(rank, specs)
    got_layers = cat["layer_sharded"] + cat["layer_replicated"]
    expect(got_layers == expected_layers, f"layer bytes {got_layers} != layout's {expected_layers}")
    if len(set(layout.train.stage_layer_counts(num_layers))) > 1:
        return {"received": stats["received_bytes"], "uneven": True, **cat}
    sharded_m = sum(s.num_bytes for s in specs if s.kind != PartitionKind.REPLICATED)
    formula = hybridflow_bytes(layout, sharded_m)
    expect(
        cat["layer_sharded"] == formula, f"sharded layer bytes {cat['layer_sharded']} != formula {formula}"
    )
    replicated_m = sum(s.num_bytes for s in specs if s.kind == PartitionKind.REPLICATED)
    q, p = layout.pp_ratio, layout.train.pp
    expect(cat["layer_replicated"] * p == (q - 1) * replicated_m, "replicated layer bytes != (q-1)/p * R")
    return {"received": stats["received_bytes"], "formula_sharded": int(formula), **cat}


def check_reshard(groups, rtp, rpp, tie, keep=False, bucket_bytes=None, num_layers=NUM_LAYERS) -> dict:
    """Two round trips on a freshly built model; returns figures for the summary."""
    tp, pp, vpp = groups.dims.tp, groups.dims.pp, groups.dims.vpp
    rank = groups.rank
    _, chunks = build(groups, tie, num_layers=num_layers)
    before = snapshot(chunks)
    naive = NaiveGather(chunks, groups, num_layers, tie)
    full = dict(naive.to_rollout().params)
    expect(
        sorted({int(n.split(".")[2]) for n in full if n.startswith("decoder.layers.")})
        == list(range(num_layers)),
        "the full weights must hold every layer",
    )
    naive.to_train()
    start = time.perf_counter()
    engine = HybridEngine(chunks, groups, num_layers, tie, rtp, rpp, keep, bucket_bytes)
    build_s = time.perf_counter() - start
    expect(engine.in_place, "plain megatron parameters must be re-pointed in place")
    params = list(global_param_names(chunks, engine.layout.train.layers(groups.pp_rank, num_layers)).values())
    t_lo = engine._train_buf.data_ptr()
    t_hi = t_lo + engine._train_buf.numel()
    figures = {}
    for _ in range(2):
        weights = engine.to_rollout()
        errors = verify_rollout(weights, full, engine.layout, rank, num_layers, tie)
        expect(not errors, f"({tp},{pp},vpp{vpp})->({rtp},{rpp}) tie={tie}: " + "; ".join(errors[:5]))
        figures = check_bytes(engine, full, rank, num_layers)
        rollout_bytes = sum(t.numel() * t.element_size() for t in weights.params.values())
        alive = engine.alive_bytes()
        if not engine.plan.regroup:  # every rollout tensor is a view of T or of the receive buffer
            expect(engine.last_stats["copied_bytes"] == 0, "no local copy expected without TP regrouping")
            expect(
                alive["gathered"] == engine.last_stats["received_bytes"], "receive buffer != bytes received"
            )
            storages = {
                b.untyped_storage().data_ptr() for b in [engine._train_buf, *engine._recv] if b is not None
            }
            for name, t in weights.params.items():
                expect(t.untyped_storage().data_ptr() in storages, f"{name} is not a view of T or G")
        else:
            expect(alive["regrouped"] == engine.plan.regroup_bytes, "regroup buffer size")
        buffers = [b for b in [*engine._recv, engine._regroup_buf] if b is not None]
        refs = [weakref.ref(b) for b in buffers]
        del buffers
        engine.to_train()
        alive_after = engine.alive_bytes()
        if keep:
            expect(alive_after == alive, "keep_rollout_weights must keep the rollout buffers")
            expect(len(weights.params) > 0, "keep_rollout_weights must keep the handed-out views")
        else:
            expect(
                alive_after["gathered"] == 0 and alive_after["regrouped"] == 0, f"alive after: {alive_after}"
            )
            expect(len(weights.params) == 0, "to_train must drop the handed-out rollout views")
            del weights  # no gc.collect(): the buffers must be freed by reference counting alone
            expect(all(r() is None for r in refs), "a gathered buffer is still alive after to_train")
        for i, c in enumerate(chunks):
            for n, p in c.named_parameters():
                expect(torch.equal(p, before[f"{i}.{n}"]), f"training parameter {n} changed")
        for p in params:
            expect(t_lo <= p.data_ptr() < t_hi, "a training parameter left the training buffer")
    figures.update(
        rollout_bytes=rollout_bytes,
        train_bytes=alive["train"],
        gathered_bytes=alive["gathered"],
        regrouped_bytes=alive["regrouped"],
        rounds=engine.last_stats["rounds"],
        build_s=round(build_s, 3),
    )
    return figures


def micro_batches(groups, num: int) -> list[dict]:
    g = torch.Generator().manual_seed(100 + groups.dp_rank)
    out = []
    for _ in range(num):
        tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
        out.append(
            {
                "tokens": tokens,
                "positions": torch.arange(16).expand(2, 16),
                "targets": tokens.roll(-1, dims=1),
            }
        )
    return out


def loss_fn(output, mb, tp_group):
    logp = token_log_probs(output, mb["targets"], tp_group)
    return -logp.sum() / logp.numel(), {}


def check_training(groups, rtp, rpp, tie, distributed_optimizer: bool, num_layers=NUM_LAYERS) -> dict:
    """A training step after a round trip equals the step of a model that never resharded."""
    pp = groups.dims.pp
    shape, chunks_a = build(groups, tie, num_layers=num_layers)
    _, chunks_b = build(groups, tie, seed=1, num_layers=num_layers)
    for a, b in zip(chunks_a, chunks_b):
        b.load_state_dict(a.state_dict())
    optim = OptimConfig(lr=1e-2, distributed_optimizer=distributed_optimizer)
    role_a = MegatronRole(chunks_a, groups, shape, optim, head="logits")
    role_b = MegatronRole(chunks_b, groups, shape, optim, head="logits")
    engine = HybridEngine(role_a.chunks, groups, num_layers, tie, rtp, rpp)
    expect(
        engine.in_place != distributed_optimizer,
        f"in_place={engine.in_place} with DO={distributed_optimizer}",
    )

    def full_weights():
        naive = NaiveGather(role_a.chunks, groups, num_layers, tie)
        return dict(naive.to_rollout().params)

    full = full_weights()
    for _ in range(2):
        errors = verify_rollout(engine.to_rollout(), full, engine.layout, groups.rank, num_layers, tie)
        expect(not errors, "before the step: " + "; ".join(errors[:5]))
        engine.to_train()
    batches = micro_batches(groups, 2 * pp)
    norms = []
    for role in (role_a, role_b):
        role.run(batches, functools.partial(loss_fn, tp_group=groups.tp), forward_only=False)
        norms.append(role.optimizer_step().grad_norm)
    expect(norms[0] == norms[1] and norms[0] > 0, f"grad norms differ: {norms}")
    for ca, cb in zip(role_a.chunks, role_b.chunks):
        for (n, pa), (_, pb) in zip(ca.named_parameters(), cb.named_parameters()):
            expect(torch.equal(pa, pb), f"after the step {n} differs from the model that never resharded")
    changed = full_weights()
    expect(any(not torch.equal(changed[n], full[n]) for n in full), "the optimizer step changed nothing")
    errors = verify_rollout(engine.to_rollout(), changed, engine.layout, groups.rank, num_layers, tie)
    expect(not errors, "after the step: " + "; ".join(errors[:5]))
    engine.to_train()
    return {"in_place": engine.in_place, "grad_norm": norms[0]}


def check_repointed_after_build() -> bool:
    """Parameters re-pointed after the engine was built (as megatron DDP with the distributed optimizer
    would) are detected: the engine warns, switches to sending a copy, and stays exact."""
    groups = setup(2, 1)
    _, chunks = build(groups, False)
    naive = NaiveGather(chunks, groups, NUM_LAYERS, False)
    full = dict(naive.to_rollout().params)
    engine = HybridEngine(chunks, groups, NUM_LAYERS, False, 1)
    param = next(chunks[0].parameters())
    param.data = param.data.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weights = engine.to_rollout()
    expect(not engine.in_place and any("re-pointed" in str(w.message) for w in caught), "no fallback")
    errors = verify_rollout(weights, full, engine.layout, groups.rank, NUM_LAYERS, False)
    expect(not errors, "after the fallback: " + "; ".join(errors[:5]))
    engine.to_train()
    return engine.in_place


def check_invalid() -> list[str]:
    """Invalid rollout layouts raise ValueError naming the key, before any collective."""
    groups = setup(2, 1)
    _, chunks = build(groups, False)
    messages = []
    for kwargs, key in (
        ({"rollout_tp": 3}, "rollout.tp"),
        ({"rollout_tp": 0}, "rollout.tp"),
        ({"rollout_tp": 1, "rollout_pp": 2}, "rollout.pp"),
        ({"rollout_tp": 1, "tie_embeddings": True}, "tie_embeddings"),
    ):
        try:
            HybridEngine(chunks, groups, NUM_LAYERS, **{"tie_embeddings": False, **kwargs})
        except ValueError as e:
            expect(key in str(e), f"{kwargs}: message does not name {key}: {e}")
            messages.append(str(e))
        else:
            raise AssertionError(f"{kwargs} did not raise")
    return messages


def check_expert_reshard(tp: int, pp: int, rtp: int) -> dict:
    """The 3D-HybridEngine (dense, skip_experts) + ExpertGather at EP=2: every rollout tensor, each routed
    expert included, equals the full weights (dense from NaiveGather, experts from every rank by global
    index); a rank receives exactly the experts it lacks, E - E / (ep * pp); to_train frees them; the
    training parameters are untouched after two round trips."""
    destroy_model_parallel_groups()
    dims = ParallelDims(world_size=int(os.environ["WORLD_SIZE"]), tp=tp, pp=pp, ep=2, sp=tp > 1)
    groups = init_distributed(dims, "cpu")
    cfg = dataclasses.replace(
        model_config(False, num_layers=4),
        moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32, shared_expert_ffn_hidden_size=48),
    )
    shape = resolve_shape(cfg, VOCAB, tp)
    torch.manual_seed(0)
    chunks = build_gpt_chunks_layout_invariant(shape, groups, init_std=0.02, recompute=False)
    before = snapshot(chunks)
    naive = NaiveGather(chunks, groups, shape.num_layers, False)
    full = {n: t.clone() for n, t in naive.to_rollout().params.items() if not is_expert_param(n)}
    naive.to_train()
    layers = dims.train_layout().layers(groups.pp_rank, shape.num_layers)
    local = global_param_names(chunks, layers, groups.expert_offset(4))
    mine = {n: p.detach().clone() for n, p in local.items() if is_expert_param(n)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for experts in everyone:
        for name, tensor in experts.items():
            expect(name not in full or torch.equal(full[name], tensor), f"{name}: replicas differ")
            full[name] = tensor
    expert_bytes = sum(t.numel() * t.element_size() for n, t in full.items() if is_expert_param(n))
    expect(len([n for n in full if is_expert_param(n)]) == 4 * 4 * 2, "4 layers x 4 experts x fc1/fc2")
    engine = HybridEngine(chunks, groups, shape.num_layers, False, rtp, skip_experts=True)
    sync = ExpertGather(engine, chunks, groups, shape.num_layers, 4, [range(shape.num_layers)])
    for _ in range(2):
        weights = sync.to_rollout()
        errors = verify_rollout(weights, full, engine.layout, groups.rank, shape.num_layers, False)
        expect(not errors, f"experts t{tp}p{pp}e2->t{rtp}: " + "; ".join(errors[:5]))
        received = sync.last_stats["expert_received_bytes"]
        expect(received == expert_bytes - expert_bytes // (2 * pp), f"expert bytes {received}")
        recv = weakref.ref(sync._recv)
        del weights
        sync.to_train()
        expect(recv() is None, "to_train must free the received experts")
    after = snapshot(chunks)
    expect(all(torch.equal(before[k], after[k]) for k in before), "training parameters changed")
    return {"expert_received_bytes": received, "expert_bytes": expert_bytes}


def check_random_init_layout_invariant(
    layouts: list[tuple[int, int, int]], tie: bool, value_head: bool
) -> list:
    """A seeded random init (`build_gpt_chunks_layout_invariant`, what a run without model.path trains) is
    the same model at every (pp, vpp, num_layers) of `layouts` as megatron's own build of the whole model
    (DP only: every layer on every rank) from the same seed: each parameter equal by global name
    (`torch.equal`); the critic's (`value_head`) too. Before, a later stage drew its layers from the start
    of the stream. Returns the layouts checked."""
    checked = []
    for num_layers in sorted({layers for _, _, layers in layouts}):
        shape = resolve_shape(model_config(tie, num_layers), VOCAB, 1)
        dp_only = setup(1, 1)
        torch.manual_seed(3)
        whole = build_gpt_chunks(shape, dp_only, init_std=0.02, recompute=False, value_head=value_head)
        reference = {n: p.detach().clone() for n, p in global_param_names(whole, [range(num_layers)]).items()}
        for pp, vpp, layers in layouts:
            if layers != num_layers:
                continue
            groups = setup(1, pp, vpp)
            torch.manual_seed(3)
            chunks = build_gpt_chunks_layout_invariant(
                shape, groups, init_std=0.02, recompute=False, value_head=value_head
            )
            local = global_param_names(chunks, groups.dims.train_layout().layers(groups.pp_rank, num_layers))
            for name, param in local.items():
                source = name
                if tie and name == "output_layer.weight" and name not in reference:  # last stage's tied copy
                    source = "embedding.word_embeddings.weight"
                expect(source in reference, f"random init p{pp}v{vpp}L{num_layers}: {name} not in the model")
                expect(
                    torch.equal(param, reference[source]),
                    f"random init p{pp}v{vpp}L{num_layers}: {name} differs",
                )
            checked.append(
                f"p{pp}v{vpp}L{num_layers}{' tied' if tie else ''}{' critic' if value_head else ''}"
            )
    return checked
