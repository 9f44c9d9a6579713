"""Benchmark one actor update: forward + backward + optimizer step through the engine's own `MegatronRole`
(engine/roles/policy.py) and actor loss (`engine.step.losses.make_actor_loss`, GRPO defaults: PPO clip, token-mean),
on a random-init conf/model preset and one fixed random batch, in one process; prints one JSON object.

    python scripts/bench/update.py --preset qwen2_5_1_5b --rows 64 --seq 768 --prompt-len 256   # one GPU
    python scripts/bench/update.py --preset tiny --rows 8 --seq 32 --prompt-len 8 --max-tokens 128  # CPU

The batch: `--rows` sequences of `--seq` tokens (`--prompt-len` prompt + the rest response, no padding,
random token ids, random advantages); with `--lengths long_tail` each row's response is as long as
`workload.response_lengths` draws (one length per row, at most `--seq` - `--prompt-len`), the same draw for
every update, or with `--fresh-lengths` a new one per update (seed + the update's index: shapes change from
update to update as in a run, so costs paid per new shape, e.g. cuDNN's plan builds, show in the timed
updates); cut into micro-batches by the engine's MicroBatcher under `--max-tokens` per micro-batch (0:
`--micro-batch` rows each; packed, as the trainer, rows sorted by length up to that many rows' tokens at the
batch's width), packed (rows back to back, varlen attention: the trainer's default) unless `--padded` (as
`trainer.pack_sequences=false`: each micro-batch (rows, its longest + 1) under a budget, (rows, the batch's
longest + 1) without; the only layout before 2026-12-03); the loss sees log-probs of the response
positions only. The process is a world of one (NCCL on GPU, gloo on CPU), parameters in `--dtype`.

Each `--variants` entry (VARIANTS below) builds a fresh model (same seed, same weights) with a set of the
layer spec's fused kernels (engine/models/spec.py `Fusions`) and the AdamW kernel MegatronRole picks or a
forced one (`adam` in the JSON says which ran), runs `--warmup` updates (torch.compile'd kernels compile
there; by default 2, on CUDA through the update where cuDNN's first plans are built: `warmup_updates`),
then times `--iters` updates, CUDA-synchronised around the schedule and around the optimizer step, so every
update gives both figures. Reported per variant (medians):
- `update_s`, `tokens_per_s`, `mfu`: forward + backward + optimizer step (the rates: medians of each
  update's own; `update_s_all`, `tokens_all` per timed update, `first_update_s` the first warm-up update,
  `warmup_s_all` every warm-up update);
- `fwd_bwd_s`, `fwd_bwd_tokens_per_s`, `fwd_bwd_mfu`: the schedule alone; `optimizer_s`: the difference;
- MFU = 6 x params x tokens / seconds / 989e12 (H100/H200 dense bf16 peak), params = every parameter of the
  model once (a tied embedding is the lm_head and counts once; untied, both count), tokens = the update's
  real tokens computed (rows x seq at fixed lengths; with `--share-prompts`, each group of `--n` rows' prompt
  once: trainer.share_prompts; its attention split at the prompt as the trainer's, or with `--gathered` each
  response's keys behind its prompt's through FlashAttention-2);
  attention score FLOPs not counted. `mfu_palm` adds them (not causal) and counts the output layer at the
  response positions only (engine/step/perf.py, the trainer's perf/mfu/actor);
- `peak_memory_gb` (max allocated during the timed updates), `grad_norm` and `loss` of the first update
  (equal across variants up to rounding: a numerics check), `skipped_steps`;
- with `--profile`: one more update under torch.profiler; the top 30 CUDA kernels by total time (on CPU:
  ops by self CPU time) go to `<out>/profile_<variant>.txt`, and `kernel_categories` (ms and share of kernel
  time by kind: gemm, attention, triton (torch.compile), norm, elementwise, ...) and `gpu_busy_fraction`
  (kernel time / wall time, pessimistic under the profiler) go to the JSON; on CUDA also the host's side,
  CPU ops by self time in `<out>/profile_<variant>_host.txt`, `host_op_ms` (their summed self time) and
  `host_ops` (ops dispatched in the update);
- with `--log-ops N`: one more update under `profiling.OpLog`: every elementwise, copy and reduction op on a
  tensor of >= N elements, by bytes, with its autograd node or calling frames, to `<out>/ops_<variant>.txt`.
`fusion_check` (run first) compares each fused kernel with its reference chain on this device at the
preset's sizes: max abs difference, share of elements that differ, each one's max error against float64.
Results are written to `<out>/update.json` after every variant, so a run cut short keeps what finished.
Run from the repository root with it on PYTHONPATH (`PYTHONPATH=. python scripts/bench/update.py ...`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fusion_check import fusion_check  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from presets import model_config  # noqa: E402
from profiling import OpLog, kernel_table  # noqa: E402
from workload import KINDS, response_lengths  # noqa: E402

from algorithms.losses import loss_normalizer
from engine.config import AlgorithmConfig, OptimConfig  # noqa: E402
from engine.models import packed_attention, shared_prompt_attention  # noqa: E402
from engine.models.builder import ModelShape, build_gpt_chunks, resolve_shape  # noqa: E402
from engine.models.spec import Fusions  # noqa: E402
from engine.roles.dynamic_batch import MicroBatcher  # noqa: E402
from engine.roles.policy import MegatronRole, torch_optimizers  # noqa: E402
from engine.step.batch import build_experience  # noqa: E402
from engine.step.losses import make_actor_loss  # noqa: E402
from engine.step.perf import shared_prompt_train_flops, train_flops  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.state import ProcessGroups, destroy_distributed, init_distributed  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100/H200 dense bf16 spec, as scripts/bench/e2e.py
TINY_VOCAB = 512  # conf/model/tiny.yaml takes the tokenizer's vocabulary; the benches fix one
KEYS = ("advantages", "rollout_log_probs")  # what the actor loss reads besides the tokens
# name -> (fused kernels of the layer spec, AdamW kernel: None = whatever MegatronRole picks, or forced)
VARIANTS = {
    "none": (Fusions(rms_norm=False, rope=False, wgrad=False, qkv_bias=False), None),
    "rms_norm": (Fusions(rms_norm=True, rope=False, wgrad=False, qkv_bias=False), None),
    "rope": (Fusions(rms_norm=False, rope=True, wgrad=False, qkv_bias=False), None),
    "wgrad": (Fusions(rms_norm=False, rope=False, wgrad=True, qkv_bias=False), None),
    "qkv_bias": (Fusions(rms_norm=False, rope=False, wgrad=False, qkv_bias=True), None),
    "all-wgrad": (Fusions(wgrad=False), None),
    "all-qkv_bias": (Fusions(qkv_bias=False), None),
    "all": (Fusions(), None),
    "all+fused_adam": (Fusions(), "fused"),
    "all+foreach_adam": (Fusions(), "foreach"),
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2_5_1_5b", help="conf/model/<preset>.yaml")
    ap.add_argument("--rows", type=int, default=64, help="sequences in the update")
    ap.add_argument("--seq", type=int, default=768, help="tokens per sequence: prompt + response")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16384, help="token budget per micro-batch (0: off)")
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=8,
        help="rows per micro-batch when --max-tokens 0 (packed: rows x the batch's width in tokens)",
    )
    ap.add_argument(
        "--padded",
        action="store_true",
        help="micro-batches padded as trainer.pack_sequences=false; default: packed "
        "(rows back to back, varlen attention: the trainer's default)",
    )
    ap.add_argument("--n", type=int, default=1, help="rows per prompt (GRPO's group size; divides --rows)")
    ap.add_argument(
        "--share-prompts",
        action="store_true",
        help="each group's prompt once per micro-batch (trainer.share_prompts); packed, without --cuda-graphs",
    )
    ap.add_argument(
        "--gathered",
        action="store_true",
        help="with --share-prompts: each response's keys gathered behind its prompt's (FlashAttention-2), where "
        "the trainer splits the attention at the prompt (engine/models/shared_prompt_split.py)",
    )
    ap.add_argument(
        "--varlen-split",
        action="store_true",
        help="with --share-prompts: the attention split at the prompt through FlashAttention-2 varlen where a "
        "micro-batch has no single shape (engine/models/shared_prompt_attention.py SPLIT_VARLEN, off by default)",
    )
    ap.add_argument("--lengths", choices=KINDS, default="fixed", help="response lengths (workload.py)")
    ap.add_argument("--fresh-lengths", action="store_true", help="long_tail: a new draw for every update")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--variants", default="all", help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed updates first; default: 2, or on CUDA through the cuDNN switch (`warmup_updates`)",
    )
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--recompute", action="store_true", help="full activation recompute (model.recompute)")
    ap.add_argument("--lr", type=float, default=1e-6, help="small: the weights barely move between updates")
    ap.add_argument("--profile", action="store_true", help="profile one more update per variant")
    ap.add_argument("--log-ops", type=int, default=0, help="log one more update's data ops on >= N elements")
    ap.add_argument(
        "--cuda-graphs", action="store_true", help="the layers from CUDA graphs (trainer.cuda_graphs)"
    )
    ap.add_argument("--no-check", action="store_true", help="skip fusion_check")
    ap.add_argument(
        "--model", action="append", default=[], metavar="KEY=INT", help="override a conf/model integer key"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=".", help="folder for update.json and the profile tables")
    args = ap.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown or not 0 < args.prompt_len < args.seq:
        ap.error(f"unknown variants {unknown} or not 0 < --prompt-len < --seq")
    if args.rows % args.n or (args.share_prompts and (args.padded or args.cuda_graphs)):
        ap.error("--n must divide --rows; --share-prompts takes packed micro-batches without --cuda-graphs")
    return args


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclasses.dataclass
class Batch:
    """One update's micro-batches, its actor loss and its rows' response lengths."""

    mbs: list[dict]
    loss_fn: Callable
    lengths: torch.Tensor
    computed: int
    """Real tokens the micro-batches compute (with --share-prompts each group's prompt once)."""


def make_batch(shape: ModelShape, args, device: torch.device, seed: int) -> Batch:
    """Random prompts and responses of `--lengths` drawn with `seed` (module docstring), cut by the engine's
    MicroBatcher."""
    gen = torch.Generator().manual_seed(seed)
    response = args.seq - args.prompt_len
    lengths = torch.tensor(response_lengths(args.lengths, args.rows, response, seed))
    groups = args.rows // args.n
    prompts = torch.randint(0, shape.vocab_size, (groups, args.prompt_len), generator=gen)
    response_ids = torch.randint(0, shape.vocab_size, (args.rows, response), generator=gen)
    mask = (torch.arange(response) < lengths[:, None]).float()
    rollout_logp = -torch.rand(args.rows, response, generator=gen) * mask
    exp = build_experience(prompts.tolist(), response_ids, mask, list(range(groups)), args.n, 0)
    exp.tensors.update(
        advantages=torch.randn(args.rows, response, generator=gen) * mask, rollout_log_probs=rollout_logp
    )
    batcher = MicroBatcher(  # one layout per call with graphs, as trainer_batcher
        args.micro_batch,
        args.max_tokens,
        seq_multiple=1,
        device=device,
        pack=not args.padded,
        shapes="graphs" if args.cuda_graphs else "free",
        share_prompts=args.share_prompts,
    )
    alg = AlgorithmConfig()
    norm = loss_normalizer(mask, alg.loss_agg_mode, max_len=response)
    mbs = batcher(exp, torch.arange(args.rows), KEYS)
    return Batch(mbs, make_actor_loss(alg, norm, kl_ref=False), lengths, batcher.token_counts[0])


def batches(shape: ModelShape, args, device: torch.device) -> Callable[[int], Batch]:
    """Update number -> its batch: one batch for all, or with --fresh-lengths one per update (cached, so every
    variant sees the same sequence)."""
    made: dict[int, Batch] = {}

    def batch_for(update: int) -> Batch:
        key = update if args.fresh_lengths else 0
        if key not in made:
            made[key] = make_batch(shape, args, device, args.seed + key)
        return made[key]

    return batch_for


MAX_AUTO_WARMUP = 10
"""The most warm-up updates `warmup_updates` picks (micro-batches of few layer calls are quick)."""


def warmup_updates(args, shape: ModelShape, b: Batch, device: torch.device) -> int:
    """`--warmup`, or where not given: 2 (the first update compiles), and on CUDA at least the update that
    holds each layer shape's `CUDNN_FROM_CALL`-th call (engine/models/packed_attention.py: equal rows and the
    shared-prompt split move to cuDNN there, whose first plans took 4.6-5.4 s the first time an H100 ran the
    shape: scripts/bench/README.md, "f292c15"), at most `MAX_AUTO_WARMUP`; 2 with --fresh-lengths, whose
    shapes rarely recur."""
    if args.warmup is not None:
        return args.warmup
    if device.type != "cuda" or args.fresh_lengths:
        return 2
    calls = shape.num_layers * len(b.mbs)  # layer calls per update, every micro-batch of the same shape
    return min(MAX_AUTO_WARMUP, max(2, math.ceil(packed_attention.CUDNN_FROM_CALL / calls)))


def set_adam_kernel(optimizer, kernel: str) -> None:
    """Force the torch AdamW inside megatron's optimizer (its fallback without apex/TE) to torch's `fused`
    single kernel or the `foreach` kernels. Param groups read the flags at each step and the state is created
    lazily, so this works before the first step."""
    for opt in torch_optimizers(optimizer):
        for group in opt.param_groups:
            group["fused"], group["foreach"] = kernel == "fused", kernel == "foreach"


def adam_kernel(optimizer) -> str:
    """Which AdamW kernel the optimizer's param groups select: fused, foreach or default (torch decides)."""
    groups = [g for opt in torch_optimizers(optimizer) for g in opt.param_groups]
    if all(g.get("fused") for g in groups):
        return "fused"
    return "foreach" if all(g.get("foreach") for g in groups) else "default"


def one_update(role: MegatronRole, mbs: list[dict], loss_fn, device: torch.device) -> dict:
    t0 = sync(device)
    outs = role.run(mbs, loss_fn, forward_only=False)
    t1 = sync(device)
    stats = role.optimizer_step()
    role.release_graphs()  # as engine/step/update.py's run_updates, after each update
    t2 = sync(device)
    loss = sum(float(o["loss"]) for o in outs if "loss" in o)
    return {
        "fwd_bwd_s": t1 - t0,
        "update_s": t2 - t0,
        "grad_norm": stats.grad_norm,
        "skipped": stats.skipped,
        "loss": loss,
    }


def batch_update(role: MegatronRole, b: Batch, device: torch.device, args) -> dict:
    """One update on batch `b`: `one_update`'s figures with the batch's response lengths and real tokens."""
    out = one_update(role, b.mbs, b.loss_fn, device)
    out["lengths"] = b.lengths
    out["tokens"] = args.rows * args.prompt_len + int(b.lengths.sum())
    out["computed_tokens"] = b.computed  # MFU: the FLOPs run (--share-prompts: fewer than the rows hold)
    return out


def profile_update(role, mbs, loss_fn, device: torch.device, path: str) -> dict:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        wall = one_update(role, mbs, loss_fn, device)["update_s"]
    out = kernel_table(prof, device, path, wall)
    if device.type == "cuda":  # the host's side: what the CPU spends launching them, op by op
        host = kernel_table(prof, torch.device("cpu"), path.replace(".txt", "_host.txt"), wall)
        ops = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
        out.update(
            host_profile=host["profile"], host_op_ms=host["kernel_ms"], host_ops=sum(e.count for e in ops)
        )
    return out


def measure_variant(name: str, shape: ModelShape, groups: ProcessGroups, batch_for, args) -> dict:
    fusions, adam = VARIANTS[name]
    device = groups.device
    torch.manual_seed(args.seed)  # same weights in every variant: torch's generators and megatron's CUDA
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)  # RNG tracker (GPU init draws from it)
    chunks = build_gpt_chunks(shape, groups, init_std=0.02, recompute=args.recompute, fusions=fusions)
    role = MegatronRole(chunks, groups, shape, OptimConfig(lr=args.lr), total_optimizer_steps=1000)
    if adam is not None:
        set_adam_kernel(role.optimizer, adam)
    if args.cuda_graphs:
        role.use_cuda_graphs()
    params = sum(p.numel() for p in {id(p): p for c in role.chunks for p in c.parameters()}.values())

    warmup = warmup_updates(args, shape, batch_for(0), device)
    warm = [batch_update(role, batch_for(i), device, args) for i in range(warmup)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs = [batch_update(role, batch_for(warmup + i), device, args) for i in range(args.iters)]
    cuda = device.type == "cuda"

    def median_rate(per_run) -> float:
        return statistics.median(per_run(r) for r in runs)

    out = {
        "fusions": dataclasses.asdict(fusions),
        "adam": adam_kernel(role.optimizer),
        "params": params,
        "update_s": statistics.median(r["update_s"] for r in runs),
        "update_s_all": [round(r["update_s"], 4) for r in runs],
        "tokens_all": [r["tokens"] for r in runs],
        "first_update_s": warm[0]["update_s"] if warm else None,
        "warmup_s_all": [round(r["update_s"], 4) for r in warm],
        "tokens_per_s": median_rate(lambda r: r["tokens"] / r["update_s"]),
        "mfu": median_rate(lambda r: 6.0 * params * r["computed_tokens"] / r["update_s"] / PEAK_BF16_FLOPS)
        if cuda
        else None,
        "fwd_bwd_s": statistics.median(r["fwd_bwd_s"] for r in runs),
        "fwd_bwd_tokens_per_s": median_rate(lambda r: r["tokens"] / r["fwd_bwd_s"]),
        "fwd_bwd_mfu": (
            median_rate(lambda r: 6.0 * params * r["computed_tokens"] / r["fwd_bwd_s"] / PEAK_BF16_FLOPS)
            if cuda
            else None
        ),
        "optimizer_s": statistics.median(r["update_s"] - r["fwd_bwd_s"] for r in runs),
        "mfu_palm": None,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
        "grad_norm": (warm or runs)[0]["grad_norm"],
        "loss": (warm or runs)[0]["loss"],
        "skipped_steps": sum(r["skipped"] for r in warm + runs),
        "cuda_graphs": role.layer_graphs is not None,
        "layer_calls_captured": role.layer_graphs.captured if role.layer_graphs else 0,
        "layer_calls_replayed": role.layer_graphs.replayed if role.layer_graphs else 0,
    }
    if cuda:  # the output layer at the response positions only, as the fused head computes

        def palm(r) -> float:
            prompts = torch.full_like(r["lengths"], args.prompt_len)
            if args.share_prompts:  # the groups of --n rows (first-seen order: rows i*n .. i*n+n-1)
                groups = [list(range(i, i + args.n)) for i in range(0, args.rows, args.n)]
                flops = shared_prompt_train_flops(shape, prompts, r["lengths"], groups)
            else:
                flops = train_flops(shape, prompts + r["lengths"], r["lengths"])
            return flops / r["update_s"] / PEAK_BF16_FLOPS

        out["mfu_palm"] = median_rate(palm)
    if args.profile:
        path = os.path.join(args.out, f"profile_{name.replace('+', '_')}.txt")
        b = batch_for(warmup + args.iters)
        out.update(profile_update(role, b.mbs, b.loss_fn, device, path))
    if args.log_ops:
        out["ops"] = os.path.join(args.out, f"ops_{name.replace('+', '_')}.txt")
        b = batch_for(warmup + args.iters)
        log = OpLog(args.log_ops)
        with log:
            one_update(role, b.mbs, b.loss_fn, device)
        log.write(out["ops"], f"one update ({len(b.mbs)} micro-batches)")
    del role, chunks
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def model_shape(args) -> ModelShape:
    overrides = {"dtype": args.dtype, "recompute": args.recompute}
    if args.preset == "tiny":
        overrides["vocab_size"] = TINY_VOCAB
    for item in args.model:  # KEY=INT: conf/model keys, e.g. a wider tiny model for a CPU probe
        key, value = item.split("=", 1)
        overrides[key] = int(value)
    cfg = model_config(args.preset, **overrides)
    return resolve_shape(cfg, cfg.vocab_size, 1)


def main() -> None:
    args = parse_args()
    if args.gathered:  # the path before the split, for a same-run comparison
        shared_prompt_attention.split_available = lambda q, k, v, kernel: False
    shared_prompt_attention.SPLIT_VARLEN = args.varlen_split
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "update.json")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    groups = init_distributed(ParallelDims(world_size=1), device_type, seed=args.seed)
    try:
        shape = model_shape(args)
        batch_for = batches(shape, args, groups.device)
        first = batch_for(0)
        result = {
            "preset": args.preset,
            "device": torch.cuda.get_device_name(groups.device) if device_type == "cuda" else "cpu",
            "torch": torch.__version__,
            "dtype": args.dtype,
            "rows": args.rows,
            "seq": args.seq,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "lengths": args.lengths,
            "fresh_lengths": args.fresh_lengths,
            "packed": "packed_seq_params" in first.mbs[0],
            "micro_batches": [list(mb["tokens"].shape) for mb in first.mbs],
            "tokens": args.rows * args.prompt_len + int(first.lengths.sum()),
            "mfu_formula": "6 * params * tokens / seconds / 989e12; params: each parameter once (tied "
            "embedding = lm_head, once); tokens: the update's real tokens computed (rows * seq at fixed lengths; "
            "with --share-prompts each group's prompt once); "
            "attention score FLOPs not counted",
            "variants": {},
        }
        if not args.no_check:  # first: quick, and its numbers matter even if a variant runs out of time
            result["fusion_check"] = fusion_check(shape, groups.device)
        for i, name in enumerate(args.variants.split(",")):
            key = name if name not in result["variants"] else f"{name}#{i + 1}"  # a variant again: run order
            try:
                result["variants"][key] = measure_variant(name, shape, groups, batch_for, args)
            except Exception as e:  # one failing variant (OOM, compile error) must not lose the others
                trace = traceback.format_exc()[-3000:]
                result["variants"][key] = {"error": f"{type(e).__name__}: {e}", "trace": trace}
                gc.collect()
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
        print(json.dumps(result), flush=True)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
