"""torchrun script of tests/parallel/test_hybrid_engine.py: every 3D-HybridEngine check for one world size
(2 or 4 CPU ranks, gloo) in one launch, because a launch costs ~10 s.

For each layout (t, p, vpp) -> (t_g, p_g) and tied/untied embeddings, even and uneven pipeline stages, on a tiny GPTModel with GQA, QKV bias
and QK-norm: rollout tensors equal the slices of NaiveGather's full weights (torch.equal); received bytes
equal the plan and HybridFlow's formula; the gathered part is freed by to_train (weak references die);
training parameters are bit-identical and still in the engine's buffer after two round trips. Then a
training step after a round trip (megatron DDP + optimizer, with and without the distributed optimizer)
equals the step of a model that never resharded. Split placement (`SPLIT_CASES`): the first ranks train, the
others receive their rollout shard with `SplitTransfer` (rollout.tp below, equal to or above parallel.tp),
checked against the full weights twice (the second time after the training weights changed), received bytes
= the rollout shard's bytes. Rank 0 prints `HYBRID_OK <json>` at the end.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import sys
import time
import warnings
import weakref

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from engine.config import ModelConfig, MoEConfig, OptimConfig
from engine.models.builder import build_gpt_chunks, build_gpt_chunks_ep_invariant, resolve_shape
from engine.models.logprobs import token_log_probs
from engine.roles.policy import MegatronRole
from parallel.dims import ParallelDims
from parallel.expert_gather import ExpertGather
from parallel.hybrid_check import hybridflow_bytes, layer_param_specs, verify_rollout
from parallel.hybrid_engine import HybridEngine
from parallel.layout import PartitionKind
from parallel.naive_gather import NaiveGather
from parallel.rollout_weights import global_param_names, is_expert_param
from parallel.split_plan import SplitLayout, rollout_shard_bytes
from parallel.split_transfer import SplitTransfer
from parallel.state import init_distributed, init_split_distributed

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
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
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


# training layout (tp, pp, vpp[, num_layers]) -> checks: ("reshard", rollout_tp, rollout_pp, tie, keep,
# bucket_bytes) or ("train", rollout_tp, rollout_pp, tie, distributed_optimizer). A layer count that pp * vpp
# does not divide takes megatron's uneven first/last stages (3 layers at PP=2: 2 then 1; 10 layers at PP=4 x
# VPP=2: 4, 2, 2, 2).
CASES = {
    2: {
        (2, 1, 1): [
            ("reshard", 1, 1, False, False, None),
            ("reshard", 1, 1, True, True, 32768),
            ("train", 1, 1, True, False),
        ],
        (1, 2, 1): [("reshard", 1, 1, True, False, None), ("reshard", 1, 2, True, False, None)],
        (1, 2, 2): [("reshard", 1, 1, False, True, None), ("train", 1, 1, True, False)],
        (1, 2, 1, 3): [
            ("reshard", 1, 1, True, False, None),
            ("reshard", 1, 2, False, False, None),
            ("train", 1, 1, True, False),
        ],
    },
    4: {
        (2, 2, 1): [
            ("reshard", 1, 1, False, False, None),
            ("reshard", 1, 1, True, False, 32768),
            ("reshard", 2, 1, False, False, None),
            ("reshard", 1, 2, True, False, None),
        ],
        (2, 2, 2): [
            ("reshard", 1, 1, True, False, None),
            ("reshard", 2, 1, True, True, None),
            ("train", 1, 1, True, False),
        ],
        (4, 1, 1): [("reshard", 2, 1, False, False, None), ("reshard", 1, 1, True, False, 65536)],
        (2, 1, 1): [("reshard", 1, 1, True, False, None), ("train", 1, 1, False, True)],
        (1, 4, 1): [("reshard", 1, 2, True, False, None)],
        (1, 4, 2): [("reshard", 1, 2, False, False, None)],
        (1, 2, 1): [("train", 1, 1, True, True)],
        (2, 2, 1, 3): [
            ("reshard", 1, 1, False, False, None),
            ("reshard", 2, 1, True, False, None),
            ("reshard", 1, 2, True, False, 32768),
            ("train", 1, 1, False, True),
        ],
        (1, 4, 2, 10): [("reshard", 1, 2, False, False, None), ("reshard", 1, 1, True, False, None)],
    },
}


# world size -> [(parallel.tp, parallel.pp, rollout.tp)] at parallel.ep=2 (tiny MoE with a shared expert)
EXPERT_CASES = {2: [], 4: [(1, 2, 1), (2, 1, 1)]}


def check_expert_reshard(tp: int, pp: int, rtp: int) -> dict:
    """The 3D-HybridEngine (dense, skip_experts) + ExpertGather at EP=2: every rollout tensor, each routed
    expert included, equals the full weights (dense from NaiveGather, experts from every rank by global
    index); a rank receives exactly the experts it lacks, E - E / (ep * pp); to_train frees them; the
    training parameters are untouched after two round trips."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dims = ParallelDims(world_size=int(os.environ["WORLD_SIZE"]), tp=tp, pp=pp, ep=2, sp=tp > 1)
    groups = init_distributed(dims, "cpu")
    cfg = dataclasses.replace(
        model_config(False, num_layers=4),
        moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32, shared_expert_ffn_hidden_size=48),
    )
    shape = resolve_shape(cfg, VOCAB, tp)
    torch.manual_seed(0)
    chunks = build_gpt_chunks_ep_invariant(shape, groups, init_std=0.02, recompute=False)
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


# world size -> [(parallel.tp, parallel.pp, placement.rollout_ranks, rollout.tp, tied, bucket bytes)]
SPLIT_CASES = {
    2: [(1, 1, 1, 1, False, None)],
    4: [
        (2, 1, 2, 1, False, None),  # two rollout replicas from one TP=2 replica: TP shards merged
        (1, 2, 2, 2, True, 4096),  # rollout.tp > parallel.tp: training shards split; many small buckets
        (1, 1, 2, 1, False, 8192),  # two training replicas, each sends to one rollout replica
        (1, 3, 1, 1, True, None),  # three uneven stages (8 layers: 3, 3, 2... megatron's rule), tied
        (
            1,
            1,
            2,
            2,
            False,
            None,
            "vllm",
        ),  # Qwen2-like (no QK-norm), into rollout.backend=vllm at rollout.tp=2
    ],
}


def check_split(
    tp: int,
    pp: int,
    rollout_ranks: int,
    rollout_tp: int,
    tie: bool,
    bucket: int | None,
    backend: str = "native",
) -> dict:
    """One split layout: SplitTransfer's shards equal the full weights' slices, before and after the
    training weights change; every rollout rank receives exactly its shard's bytes; with backend "vllm" the
    rollout ranks then feed it to the vLLM backend (`check_vllm_on_split`)."""
    config = model_config(tie, qk_norm=backend != "vllm")
    from parallel.hybrid_check import verify_split_transfer

    world = dist.get_world_size()
    dims = ParallelDims(world_size=world - rollout_ranks, tp=tp, pp=pp)
    groups, everyone = init_split_distributed(dims, world, "cpu")
    layout = SplitLayout(dims.train_layout(), rollout_tp, rollout_ranks)
    local = None
    if groups is not None:
        shape = resolve_shape(config, VOCAB, tp)
        torch.manual_seed(0)
        chunks = build_gpt_chunks(shape, groups, init_std=0.02, recompute=False)
        local = global_param_names(chunks, dims.train_layout().layers(groups.pp_rank, NUM_LAYERS))
    transfer = SplitTransfer(
        layout,
        dist.get_rank(),
        local,
        tie,
        torch.device("cpu"),
        everyone,
        datetime.timedelta(seconds=600),
        **({"bucket_bytes": bucket} if bucket else {}),
    )
    figures = {}
    for attempt in range(2):
        if groups is not None:
            transfer.send()
        else:
            weights = transfer.receive()
            assert weights.tp_size == rollout_tp and set(weights.params) == set(transfer.tensors)
            figures = {
                "received": transfer.last_stats["received_bytes"],
                "shard": rollout_shard_bytes(list(transfer.tensors.values()), rollout_tp),
                "rounds": transfer.last_stats["rounds"],
            }
        errors = verify_split_transfer(transfer, everyone)
        assert not errors, errors[:3]
        if groups is not None:
            with torch.no_grad():
                for param in local.values():
                    param.add_(1.0 + attempt)  # the next transfer must carry the new values
    if groups is None and backend == "vllm":
        figures["vllm_tensors"] = check_vllm_on_split(weights, resolve_shape(config, VOCAB, tp))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, figures)
    out = [g for g in gathered if g]
    assert len(out) == rollout_ranks and all(g["received"] == g["shard"] for g in out), out
    return {"rollout_ranks": out, "tied": tie}


def check_vllm_on_split(weights, shape) -> int:
    """A rollout rank of split placement with rollout.backend=vllm, vLLM 0.26 stood in for by
    tests/engine/fake_vllm.py (on "cuda:0"; CPU underneath): the engine takes the received shard as
    engine/split/worker.py hands it over (its TP group, the transfer's, is vLLM's group of consecutive ranks)
    and after a rollout holds every vLLM parameter exactly as vLLM shards the full HF tensors, rebuilt from the
    rollout TP group's shards (which `verify_split_transfer` proved to be the actor's weights): what colocated
    placement loads into vLLM (tests/engine/rollout_tp_script.py). Returns the vLLM tensors loaded."""
    import pytest

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
    import fake_vllm
    from rollout_tp_script import expected_vllm_params

    from engine.config import RolloutConfig
    from engine.models.hf_map import hf_from_shards, hf_names, match_rule
    from engine.rollout import build_rollout_engine
    from engine.rollout.base import SamplingParams

    tp, j = weights.tp_size, weights.tp_rank
    everyone: list = [None] * tp
    dist.all_gather_object(
        everyone, {n: t.clone() for n, t in weights.params.items()}, group=weights.tp_group
    )
    full = {}
    for name in weights.params:
        rule, layer = match_rule(name)
        full.update(zip(hf_names(rule, layer), hf_from_shards(rule, [e[name] for e in everyone], shape)))
    want = expected_vllm_params(full, shape.vocab_size, tp, j)
    with pytest.MonkeyPatch.context() as mp:
        fake_vllm.install(mp, {name: torch.full_like(t, float("nan")) for name, t in want.items()})
        mp.setattr(torch.cuda, "synchronize", lambda device=None: None)
        mp.setenv("LOCAL_RANK", "0")
        cfg = RolloutConfig(backend="vllm", tp=tp, cuda_graphs=False)
        engine = build_rollout_engine(cfg, shape, torch.device("cuda", 0), 0, seed=1)
        engine.set_weights(weights)  # checks vLLM's TP group against the transfer's
        out = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(n=2, max_new_tokens=4, seed=3))
        params = fake_vllm.LLM.instances[-1].model.params
        for name, tensor in want.items():
            assert torch.equal(params[name].data, tensor), name
    gathered: list = [None] * tp
    dist.all_gather_object(gathered, out.response_ids, group=weights.tp_group)
    assert all(torch.equal(g, out.response_ids) for g in gathered)  # one vLLM engine per TP group
    return engine.last_stats["tensors"]


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    start = time.perf_counter()
    summary = {"world": world, "reshard": {}, "training": {}}
    for (tp, pp, vpp, *layers), checks in CASES[world].items():
        num_layers = layers[0] if layers else NUM_LAYERS
        groups = setup(tp, pp, vpp)
        for what, rtp, rpp, tie, *rest in checks:
            key = f"t{tp}p{pp}v{vpp}L{num_layers}->t{rtp}p{rpp}{' tied' if tie else ''}"
            if what == "reshard":
                keep, bucket = rest
                summary["reshard"][key + (" keep" if keep else "")] = check_reshard(
                    groups, rtp, rpp, tie, keep, bucket, num_layers
                )
            else:
                (do,) = rest
                summary["training"][key + (" distopt" if do else "")] = check_training(
                    groups, rtp, rpp, tie, do, num_layers
                )
    summary["experts"] = {
        f"t{tp}p{pp}e2->t{rtp}": check_expert_reshard(tp, pp, rtp) for tp, pp, rtp in EXPERT_CASES[world]
    }
    summary["split"] = {}
    for tp, pp, k, rtp, tie, bucket, *backend in SPLIT_CASES[world]:
        key = f"t{tp}p{pp}+{k} rollout t{rtp}{' tied' if tie else ''}{f' bucket {bucket}' if bucket else ''}"
        summary["split"][key + "".join(f" {b}" for b in backend)] = check_split(
            tp, pp, k, rtp, tie, bucket, *backend
        )
    if world == 2:
        summary["invalid"] = check_invalid()
        summary["in_place_after_repoint"] = check_repointed_after_build()
    summary["seconds"] = round(time.perf_counter() - start, 2)
    if dist.get_rank() == 0:
        print("HYBRID_OK " + json.dumps(summary), flush=True)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
