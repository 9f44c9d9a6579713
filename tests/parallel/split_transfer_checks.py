"""Checks of split placement for tests/parallel/hybrid_reshard_script.py (run under torchrun, gloo): the first
ranks train and send with `SplitTransfer`, the others receive their rollout shard, checked against the full
weights; optionally the received shard loaded into the vLLM backend (tests/engine/fake_vllm.py stands in).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from hybrid_reshard_checks import NUM_LAYERS, VOCAB, model_config

from engine.models.builder import build_gpt_chunks, resolve_shape
from parallel.dims import ParallelDims
from parallel.rollout_weights import global_param_names
from parallel.split_plan import SplitLayout, rollout_shard_bytes
from parallel.split_transfer import SplitTransfer
from parallel.state import init_split_distributed


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
