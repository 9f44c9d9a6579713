"""Benchmark the train -> rollout weight transition: the 3D-HybridEngine against NaiveGather (every rank
gathers the full model), on the same model and layout, in one run; prints one JSON object (rank 0).

    torchrun --nproc_per_node=4 scripts/bench/reshard.py --preset qwen2_5_1_5b --tp 2 --pp 2 --rollout-tp 1
    torchrun --nproc_per_node=4 scripts/bench/reshard.py --layers 8 --hidden 512 --ffn 1536 --heads 8 \
        --groups 4 --vocab 8192 --tp 2 --pp 2 --rollout-tp 1 --verify        # CPU (gloo) when no GPU

Per method: `to_rollout` and `to_train` seconds (median of --iters, CUDA-synchronised), bytes received per
rank (measured from the tensors each method receives, and the formula), and memory: on GPU the peak of
`torch.cuda.max_memory_allocated` above the training state during `to_rollout` and what is still held
after it; on CPU the sum of bytes allocated by `to_rollout` (a dispatch-mode counter). `--verify` compares
every rollout tensor with the slice of NaiveGather's full weights and exits non-zero on a mismatch.

Split placement (`--rollout-ranks K`): the first world - K ranks train with --tp/--pp, the last K receive their
rollout shard (--rollout-tp) with `parallel/split_transfer.py`. Reported: the transfer's seconds (median of
--iters, all ranks synchronised), the bytes each rollout rank receives (= its shard), and the bandwidth bound
beside it: the busiest rollout rank's bytes over the point-to-point bandwidth measured on the same link
(one message of the same size from its first sender). `--verify` rebuilds every full tensor from the training
shards (plain send/recv) and compares.

    torchrun --nproc_per_node=2 scripts/bench/reshard.py --preset qwen2_5_1_5b --rollout-ranks 1 --verify

Mixture-of-experts (`--preset tiny_moe`, or --experts N with --ep): the dense weights take the same two
methods, and at --ep > 1 both are wrapped in `ExpertGather` (every rank receives the routed experts of its
rollout layers that it lacks); `--verify` checks the experts against every rank's training experts.

    torchrun --nproc_per_node=4 scripts/bench/reshard.py --preset tiny_moe --pp 2 --ep 2 --verify
    torchrun --nproc_per_node=4 scripts/bench/reshard.py --preset tiny_moe --tp 2 --ep 2 --verify
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from engine.config import ModelConfig, MoEConfig, OptimConfig
from engine.models.builder import build_gpt_chunks, build_gpt_chunks_layout_invariant, resolve_shape
from parallel import naive_gather
from parallel.dims import ParallelDims
from parallel.expert_gather import ExpertGather
from parallel.hybrid_check import AllocationCounter, gather_full_experts, hybridflow_bytes, verify_rollout
from parallel.hybrid_engine import DEFAULT_BUCKET_BYTES, HybridEngine
from parallel.hybrid_layout import ParamSpec
from parallel.layout import PartitionKind
from parallel.rollout_weights import is_expert_param, partition_kind, split_layer_name
from parallel.state import destroy_distributed, init_distributed, world_size_from_env

PRESETS = {  # Qwen2.5 shapes (config.json of the Hugging Face checkpoints)
    "qwen2_5_0_5b": dict(layers=24, hidden=896, ffn=4864, heads=14, groups=2, vocab=151936, tie=True),
    "qwen2_5_1_5b": dict(layers=28, hidden=1536, ffn=8960, heads=12, groups=2, vocab=151936, tie=True),
    "qwen2_5_7b": dict(layers=28, hidden=3584, ffn=18944, heads=28, groups=4, vocab=152064, tie=False),
    # conf/model/tiny_moe.yaml's shape (4 routed experts, top-2) with 4 layers, so that PP=2 has 2 per stage
    "tiny_moe": dict(
        layers=4, hidden=64, ffn=192, heads=4, groups=2, vocab=256, tie=False, experts=4, expert_ffn=64
    ),
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="Qwen2.5 shape (QKV bias); overrides the shape")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4, help="key/value heads (GQA)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=0, help="routed experts per layer (0: dense)")
    ap.add_argument("--expert-ffn", type=int, default=0, help="an expert's FFN width (0: --ffn)")
    ap.add_argument("--ep", type=int, default=1, help="parallel.ep (MoE)")
    ap.add_argument("--tie", action="store_true", help="tied embeddings (presets set their own)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tp", type=int, default=1, help="parallel.tp")
    ap.add_argument("--pp", type=int, default=1, help="parallel.pp")
    ap.add_argument("--vpp", type=int, default=1, help="parallel.vpp")
    ap.add_argument("--rollout-tp", type=int, default=1, help="rollout.tp")
    ap.add_argument("--rollout-pp", type=int, default=1, help="rollout.pp")
    ap.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20, help="regroup staging")
    ap.add_argument("--iters", type=int, default=7, help="timed round trips per method (after one warm-up)")
    ap.add_argument("--distopt", action="store_true", help="wrap in megatron DDP + distributed optimizer")
    ap.add_argument("--verify", action="store_true", help="check every rollout tensor against full weights")
    ap.add_argument("--rollout-ranks", type=int, default=0, help="split placement: the last K ranks receive")
    return ap.parse_args()


def model_config(args: argparse.Namespace) -> ModelConfig:
    shape = dict(PRESETS[args.preset]) if args.preset else {}
    get = lambda key: shape.get(key, getattr(args, key))  # noqa: E731
    experts = get("experts")
    moe = MoEConfig(
        num_experts=experts, top_k=min(2, experts), ffn_hidden_size=get("expert_ffn") or get("ffn")
    )
    return ModelConfig(
        name=args.preset or "custom",
        num_layers=get("layers"),
        hidden_size=get("hidden"),
        ffn_hidden_size=get("ffn"),
        num_attention_heads=get("heads"),
        num_query_groups=get("groups"),
        vocab_size=get("vocab"),
        qkv_bias=True,
        tie_embeddings=get("tie"),
        dtype=args.dtype,
        moe=moe if experts else MoEConfig(),
    )


class _CountingDist:
    """`torch.distributed` as NaiveGather sees it, counting the bytes this rank receives."""

    def __init__(self):
        self.received = 0

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_gather(self, parts, tensor, group=None, async_op=False):
        self.received += (
            sum(p.numel() * p.element_size() for p in parts) - tensor.numel() * tensor.element_size()
        )
        return dist.all_gather(parts, tensor, group=group, async_op=async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        if dist.get_rank() != src:
            self.received += tensor.numel() * tensor.element_size()
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device):
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def time_round_trips(methods: dict, device: torch.device, iters: int, counter: _CountingDist) -> dict:
    """Warm-up, then `iters` round trips per method, interleaved so that both see the same machine load."""
    for method in methods.values():
        method.to_rollout()
        method.to_train()
    up = {name: [] for name in methods}
    down = {name: [] for name in methods}
    received = {}
    for _ in range(iters):
        for name, method in methods.items():
            counter.received = 0
            weights, seconds = _timed(method.to_rollout, device)
            up[name].append(seconds)
            stats = getattr(method, "last_stats", {})  # NaiveGather keeps none: its bytes are counted
            received[name] = (
                counter.received + stats.get("expert_received_bytes", 0)
                if name == "naive"
                else (stats["received_bytes"])
            )
            del weights
            _, seconds = _timed(method.to_train, device)
            down[name].append(seconds)
    return {
        name: {
            "to_rollout_s": statistics.median(up[name]),
            "to_train_s": statistics.median(down[name]),
            "received_bytes": received[name],
        }
        for name in methods
    }


def measure_memory(method, device: torch.device):
    """Memory of one `to_rollout`; returns the figures and the weights (call `method.to_train()` after)."""
    memory: dict[str, int] = {}
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        weights = method.to_rollout()
        _sync(device)
        memory["peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - base
        memory["held_bytes"] = torch.cuda.memory_allocated(device) - base
    else:
        with AllocationCounter() as alloc:
            weights = method.to_rollout()
        memory["allocated_bytes"] = alloc.bytes
    return memory, weights


def param_specs(full: dict[str, torch.Tensor], engine: HybridEngine, num_layers: int) -> list[ParamSpec]:
    specs = []
    for name, tensor in full.items():
        parts = split_layer_name(name)
        if parts is not None:
            stage = engine.layout.train.stage_of_layer(parts[0], num_layers)
        else:
            stage = 0 if name.startswith("embedding.") else engine.layout.train.pp - 1
        specs.append(ParamSpec(tensor.numel() * tensor.element_size(), partition_kind(name), stage))
    return specs


def p2p_seconds(src: int, dst: int, num_bytes: int, device: torch.device, iters: int) -> float:
    """Median seconds of one `num_bytes` message from `src` to `dst` (every rank takes part in the timing)."""
    buf = torch.empty(num_bytes, dtype=torch.uint8, device=device) if dist.get_rank() in (src, dst) else None
    times = []
    for _ in range(iters + 1):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        if dist.get_rank() == src:
            dist.send(buf, dst)
        elif dist.get_rank() == dst:
            dist.recv(buf, src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def split_main(args: argparse.Namespace) -> int:
    """--rollout-ranks: time `SplitTransfer` and print it beside its bandwidth bound (rank 0)."""
    import datetime

    from parallel.hybrid_check import verify_split_transfer
    from parallel.rollout_weights import global_param_names
    from parallel.split_plan import SplitLayout, rollout_shard_bytes
    from parallel.split_transfer import SplitTransfer
    from parallel.state import init_split_distributed

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = world_size_from_env()
    dims = ParallelDims(world_size=world - args.rollout_ranks, tp=args.tp, pp=args.pp)
    groups, everyone = init_split_distributed(dims, world, device_type)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    )
    try:
        cfg = model_config(args)
        shape = resolve_shape(cfg, cfg.vocab_size, dims.tp)
        layout = SplitLayout(dims.train_layout(), args.rollout_tp, args.rollout_ranks)
        local = None
        if groups is not None:
            torch.manual_seed(0)
            chunks = build_gpt_chunks(shape, groups, init_std=0.02, recompute=False)
            local = global_param_names(chunks, dims.train_layout().layers(groups.pp_rank, shape.num_layers))
        transfer = SplitTransfer(
            layout,
            dist.get_rank(),
            local,
            shape.tie_embeddings,
            device,
            everyone,
            datetime.timedelta(seconds=600),
            bucket_bytes=int(args.bucket_mb * 2**20),
        )
        step = transfer.send if groups is not None else transfer.receive
        seconds = [_timed(step, device)[1] for _ in range(args.iters + 1)][1:]
        shard = rollout_shard_bytes(list(transfer.tensors.values()), args.rollout_tp)
        first = layout.rollout_rank(0, 0)
        first_sender = min(b.src for b in transfer.buckets if b.dst == first)
        link = p2p_seconds(first_sender, first, shard, device, args.iters)
        errors = verify_split_transfer(transfer, everyone) if args.verify else []
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, {"seconds": statistics.median(seconds), "errors": errors[:5]})
        result = {
            "mode": "split",
            "model": {"name": cfg.name, "dtype": args.dtype, "shard_bytes": shard},
            "layout": {"train": dims.world_size, "tp": dims.tp, "pp": dims.pp, "dp": dims.dp},
            "rollout": {"ranks": args.rollout_ranks, "tp": args.rollout_tp, "dp": layout.rollout_dp},
            "device": device_type,
            "backend": dist.get_backend(),
            "bucket_mb": args.bucket_mb,
            "rounds": transfer.num_rounds,
            "transfer_s": max(r["seconds"] for r in per_rank),
            "bound_s": link,
            "bound_gb_per_s": shard / link / 1e9,
            "transfer_over_bound": max(r["seconds"] for r in per_rank) / link,
            "verify": ("failed" if any(r["errors"] for r in per_rank) else "passed")
            if args.verify
            else "skipped",
        }
        bad = {i: r["errors"] for i, r in enumerate(per_rank) if r["errors"]}
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
            if bad:
                print(f"VERIFY FAILED on ranks {sorted(bad)}: {bad}", file=sys.stderr, flush=True)
        return 1 if bad else 0
    finally:
        destroy_distributed()


def main() -> int:
    args = parse_args()
    if args.rollout_ranks:
        return split_main(args)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = model_config(args)
    num_experts = cfg.moe.num_experts
    dims = ParallelDims(
        world_size=world_size_from_env(),
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        ep=args.ep,
        sp=bool(num_experts) and args.tp > 1,  # megatron's MoE layers need SP at TP > 1
    )
    groups = init_distributed(dims, device_type)
    try:
        shape = resolve_shape(cfg, cfg.vocab_size, dims.tp)
        torch.manual_seed(0)
        build = build_gpt_chunks_layout_invariant if num_experts else build_gpt_chunks
        chunks = build(shape, groups, init_std=0.02, recompute=False)
        if args.distopt:
            from engine.roles.policy import MegatronRole

            chunks = MegatronRole(chunks, groups, shape, OptimConfig(distributed_optimizer=True)).chunks
        counter = _CountingDist()
        naive_gather.dist = counter
        naive = naive_gather.NaiveGather(chunks, groups, shape.num_layers, shape.tie_embeddings)
        engine = HybridEngine(
            chunks,
            groups,
            shape.num_layers,
            shape.tie_embeddings,
            args.rollout_tp,
            args.rollout_pp,
            bucket_bytes=int(args.bucket_mb * 2**20),
            skip_experts=dims.ep > 1,
        )
        baseline, ours = naive, engine
        if dims.ep > 1:
            layers = engine.layout.rollout_layers(groups.rank, shape.num_layers)
            args_ = (chunks, groups, shape.num_layers, num_experts)
            ours = ExpertGather(engine, *args_, layers)
            baseline = ExpertGather(naive, *args_, [range(shape.num_layers)])
        timing = time_round_trips({"naive": baseline, "ours": ours}, groups.device, args.iters, counter)
        memory, full = measure_memory(baseline, groups.device)
        naive_fig = {**timing["naive"], **memory}
        full = {n: t for n, t in full.params.items() if not (num_experts and is_expert_param(n))}
        if num_experts:  # an independent reference for the experts
            full.update(gather_full_experts(chunks, groups, shape.num_layers, num_experts))
        memory, weights = measure_memory(ours, groups.device)
        ours_fig = {**timing["ours"], **memory}
        errors = []
        if args.verify:
            errors = verify_rollout(
                weights, full, engine.layout, groups.rank, shape.num_layers, shape.tie_embeddings
            )
        expert_bytes = sum(t.numel() * t.element_size() for n, t in full.items() if is_expert_param(n))
        dense = {n: t for n, t in full.items() if not is_expert_param(n)}
        specs = param_specs(dense, engine, shape.num_layers)
        model_bytes = sum(s.num_bytes for s in specs) + expert_bytes
        layer_bytes = sum(s.num_bytes for s, n in zip(specs, dense) if split_layer_name(n) is not None)
        sharded_layer_bytes = sum(
            s.num_bytes
            for s, n in zip(specs, dense)
            if split_layer_name(n) is not None and s.kind != PartitionKind.REPLICATED
        )
        ours_fig.update(
            in_place=engine.in_place,
            rounds=engine.last_stats["rounds"],
            peak_buffer_bytes=engine.last_stats["peak_buffer_bytes"],
            received_by_category=engine.plan.received_by_category,
            layout_formula_bytes=engine.layout.received_bytes(groups.rank, specs),
            hybridflow_formula_sharded_layer_bytes=hybridflow_bytes(engine.layout, sharded_layer_bytes),
            alive_bytes=engine.alive_bytes(),
            rollout_weight_bytes=sum(t.numel() * t.element_size() for t in weights.params.values()),
        )
        if dims.ep > 1:  # E / p_g of the experts in the rollout, E / (ep * p) of them already here
            own = expert_bytes // (dims.ep * dims.pp)
            ours_fig.update(
                expert_received_bytes=ours.last_stats["expert_received_bytes"],
                expert_formula_bytes=expert_bytes // args.rollout_pp - own,
            )
        naive_fig["layout_formula_bytes"] = engine.layout.naive_received_bytes(groups.rank, specs)
        del weights, full, dense
        ours.to_train()
        baseline.to_train()
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, {"ours": ours_fig, "naive": naive_fig, "errors": errors[:5]})
        result = {
            "model": {
                "name": cfg.name,
                "layers": shape.num_layers,
                "hidden": shape.hidden_size,
                "ffn": shape.ffn_hidden_size,
                "heads": shape.num_attention_heads,
                "groups": shape.num_query_groups,
                "vocab": shape.padded_vocab_size,
                "tie": shape.tie_embeddings,
                "dtype": args.dtype,
                "model_bytes": model_bytes,
                "layer_bytes": layer_bytes,
                "experts": num_experts,
                "expert_bytes": expert_bytes,
            },
            "layout": {
                "world": dims.world_size,
                "tp": dims.tp,
                "pp": dims.pp,
                "vpp": dims.vpp,
                "dp": dims.dp,
                "ep": dims.ep,
                "rollout_tp": args.rollout_tp,
                "rollout_pp": args.rollout_pp,
                "micro_dp": engine.layout.micro_dp_size,
            },
            "device": device_type,
            "backend": dist.get_backend(),
            "iters": args.iters,
            "ours_rank0": per_rank[0]["ours"],
            "naive_rank0": per_rank[0]["naive"],
            "ours_max_received_bytes": max(r["ours"]["received_bytes"] for r in per_rank),
            "naive_max_received_bytes": max(r["naive"]["received_bytes"] for r in per_rank),
            "ours_max_to_rollout_s": max(r["ours"]["to_rollout_s"] for r in per_rank),
            "naive_max_to_rollout_s": max(r["naive"]["to_rollout_s"] for r in per_rank),
            "verify": ("failed" if any(r["errors"] for r in per_rank) else "passed")
            if args.verify
            else "skipped",
        }
        bad = {i: r["errors"] for i, r in enumerate(per_rank) if r["errors"]}
        if groups.is_logging_rank:
            print(json.dumps(result), flush=True)
            if bad:
                print(f"VERIFY FAILED on ranks {sorted(bad)}: {bad}", file=sys.stderr, flush=True)
        return 1 if bad else 0
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
