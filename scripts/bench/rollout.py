"""Benchmark rollout: generated tokens/s of the native engine, vLLM and transformers `generate` on the same
random-init model and the same prompts, in one run; prints one JSON object.

    python scripts/bench/rollout.py --preset qwen2_5_0_5b              # GPU: 512 prompts x 256 -> 512 tokens
    python scripts/bench/rollout.py --preset tiny                      # CPU smoke test (64 x 32 -> 64)
    python scripts/bench/rollout.py --preset tiny --compare-shims      # CPU: also the decode loop with the
                                                                       # megatron CPU shims' overhead left on
    python scripts/bench/rollout.py --preset qwen1_5_moe_a2_7b --backends native,vllm   # GPU: MoE
    python scripts/bench/rollout.py --preset tiny_moe --backends native                 # CPU MoE smoke test

Model: a preset from conf/model/ (qwen2_5_0_5b, qwen2_5_1_5b, qwen2_5_7b and the mixture of experts
qwen1_5_moe_a2_7b in bfloat16, or the tiny CPU models tiny and tiny_moe in float32 with a 512-token
vocabulary), weights drawn at random (std 0.02) directly in the rollout layout (TP=1; an MoE layer's routed
experts as views of one (experts, ...) tensor per weight, so the native engine's grouped expert GEMMs use them
without a copy); vLLM gets the same weights through its weight loader, transformers through the HF weight map.
Sampling: temperature 1, no top-k/top-p, EOS ignored (every response is --new-tokens long, or with
`--lengths long_tail` as long as scripts/bench/workload.py draws it per prompt: same lengths for every backend). Each backend is
warmed up on the same batch first (8 new tokens; with per-prompt lengths, lengths 1..512 so that every decode
width and split count is compiled before the timed call: `warm_up`; the native backends are all warmed up
before any is timed); the timed call is one `generate` (CUDA-synchronised; `--repeats N`: N per native backend,
in rounds that each start with the next backend, and their median), including what a rollout pays each time: the native engine's KV cache allocation and CUDA-graph capture, and
vLLM's wake-up, weight copy and sleep (reported separately as `wake_load_s` / `sleep_s`). A backend that is
not installed (vLLM) or not available here (vLLM on CPU) is reported as skipped with the reason; a vLLM run that
fails is reported as `{"error": ...}` (traceback on stderr) and the other backends still run.
`native_plain`: the native engine with its CUDA kernels off (`DecodeKernels(attention="sdpa",
compiled=False)`: masked SDPA decode attention, eager elementwise ops), the baseline those kernels are
measured against in the same run; `native_flash`: FlashAttention-2 decode attention instead of the Triton
kernel, compiled elementwise ops (both skipped on CPU, where every variant is the plain path);
`native_contiguous`: the native engine without paged KV (`paged_kv=False`: every slot holds the longest
row's positions, so the KV budget bounds the batch by the longest row); `native_unfused`: the compiled RoPE,
indexed K/V writes and compiled split merge instead of their Triton kernels (`DecodeKernels(fused=False)`);
`native_rope_kernel`: RoPE and the K/V writes as their own Triton kernel before the attention instead of
inside it (`DecodeKernels(rope_in_attention=False)`);
`native_torch_sampler`: the torch draw on float32 logits instead of the Triton draw
(`DecodeKernels(sampler=False)`; `native_plain` has the torch draw too); with `--n` > 1, `native_unshared`:
every sample reads its own copy of its prompt's K/V (`DecodeKernels(shared_prefix=False)`; the default reads
it from the group's first live sample's copy); `native_tiles`: the Triton decode attention with the key block,
warps, pipeline stages and optional register cap of `--attention-tiles` (`DecodeKernels(attention_tiles=...)`);
`native_uncapped`: every decode attention launch at the kernel's own register count (the default caps each
launch at the registers that fit its programs in the fewest waves: `DecodeKernels(attention_occupancy=False)`);
`native_cublas_mlp`: a dense MLP at <= 64 rows as cuBLAS fc1, the compiled SwiGLU and cuBLAS fc2 instead of
the two Triton kernels of engine/rollout/triton_mlp.py (`DecodeKernels(mlp=False)`).
`--n`: samples per prompt (GRPO's group; rows = prompts x n, a prompt's samples share its length limit).
`greedy_agree_first_token`: fraction of the first 32 prompts on which the backend's first greedy token equals
the native engine's (a check that every backend runs the same weights; bf16 may disagree on near ties).
`--profile DIR`: one more `generate` of the same batch under torch.profiler per native backend (`native` and
the kernel variants): the top 30 kernels to DIR/profile_<backend>_<preset>.txt and GPU time by kernel kind in
the JSON (`<backend>.profile`). With CUDA graphs the profiler attributes the replayed kernels too (CUPTI);
`--no-cuda-graphs` profiles the eager decode.
Native `engine_stats`, with per-prompt limits: `decode_ms_per_step_by_width` (host clock between the engine's
host checks; a width's first interval holds its CUDA-graph capture), `capture_ms_by_width` (each bucket's
warm-up and capture in the timed call, any compile included: engine/rollout/cuda_graphs.py
`capture_seconds`), `decode_ms_per_step_by_width_without_capture`, and on GPU for dense presets
`roofline_ms_per_step_by_width` (roofline.py's steps grouped by the widths the engine ran; `_this_gpu` too).
`roofline` (GPU, dense presets): the H200 decode roofline of the workload (roofline.py: prefill at 790 TFLOP/s,
each decode step at max(weights + live rows' K/V at 4.8 TB/s, FLOPs at 790 TFLOP/s)); each timed backend's
`roofline_fraction` = roofline seconds / its seconds. On another card that roofline.py knows (an H100:
3.35 TB/s), also `roofline_this_gpu` (the same roofline at that card's bandwidth) and each backend's
`roofline_fraction_this_gpu`: the issue's fraction is the H200's, which reads low on a slower card.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import traceback
from dataclasses import replace

import torch
from rollout_models import PRESETS, TINY, model_shape, random_rollout_weights
from roofline import add_rooflines, dense  # scripts/bench/ is the script's directory
from workload import KINDS, describe, response_lengths

from engine.models.hf_map import hf_from_shards, hf_names, match_rule
from engine.rollout import triton_decode
from engine.rollout.base import SamplingParams
from engine.rollout.model import DecodeKernels
from engine.rollout.occupancy import launched_kernels
from parallel.dims import ParallelDims
from parallel.state import destroy_distributed, init_distributed

VARIANTS = {  # the native engine with other kernels, against `native` (auto) in the same run
    "native_flash": DecodeKernels(attention="flash"),
    "native_plain": DecodeKernels(attention="sdpa", compiled=False, sampler=False),
    "native_unfused": DecodeKernels(fused=False),
    "native_rope_kernel": DecodeKernels(rope_in_attention=False),
    "native_torch_sampler": DecodeKernels(sampler=False),
    "native_unshared": DecodeKernels(shared_prefix=False),
    "native_uncapped": DecodeKernels(attention_occupancy=False),
    "native_cublas_mlp": DecodeKernels(mlp=False),
}
BACKENDS = ("native", "native_contiguous", *VARIANTS, "native_tiles", "vllm", "transformers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=PRESETS, default="tiny")
    ap.add_argument(
        "--backends",
        help=f"comma-separated subset of {','.join(BACKENDS)} (default: all; native_tiles with --attention-tiles)",
    )
    ap.add_argument("--prompts", type=int, help="default 512 (64 for the tiny presets)")
    ap.add_argument("--prompt-len", type=int, help="default 256 (32 for the tiny presets)")
    ap.add_argument("--new-tokens", type=int, help="default 512 (64 for the tiny presets)")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument(
        "--max-num-seqs", type=int, help="rollout.max_num_seqs for native and vLLM (default: all rows)"
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45, help="vLLM")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="native: eager decode on CUDA")
    ap.add_argument(
        "--compare-shims", action="store_true", help="CPU: also time native with the shim overhead"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-log-probs",
        action="store_true",
        help="ask no sampled-token log-probs (vLLM pays ~40%% for them)",
    )
    ap.add_argument(
        "--lengths",
        choices=KINDS,
        default="fixed",
        help="response lengths: fixed at --new-tokens, or long_tail up to it (scripts/bench/workload.py)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed generate calls per native backend, in rounds that each start with the next backend: "
        "`seconds` is their median, `seconds_each` all of them",
    )
    ap.add_argument(
        "--attention-tiles",
        metavar="BLOCK,WARPS,STAGES[,REGS]",
        help="the decode attention's tiles (and register cap) for the `native_tiles` backend, e.g. 64,4,2,120",
    )
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--profile", metavar="DIR", help="native: profile one more generate, kernel table in DIR")
    args = ap.parse_args(argv)
    if args.backends is None:
        args.backends = ",".join(b for b in BACKENDS if b != "native_tiles" or args.attention_tiles)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: time each native backend at least once (--repeats 1)")
    if ("native_tiles" in args.backends.split(",")) != (args.attention_tiles is not None):
        ap.error("the native_tiles backend and --attention-tiles go together: give both")
    if tiles := args.attention_tiles:
        try:
            args.attention_tiles = DecodeKernels(attention_tiles=tuple(map(int, tiles.split(","))))
        except (ValueError, TypeError) as err:
            ap.error(f"--attention-tiles {tiles}: {err}")
    return args


def synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed_generate(engine, prompts, sampling, device) -> tuple[object, float, float]:
    """(output, wall seconds, process CPU seconds) of one generate call after `warm_up`."""
    warm_up(engine, prompts, sampling)
    return timed_call(engine, prompts, sampling, device)


def warm_up(engine, prompts, sampling) -> None:
    """A generate before the timed ones: 8 new tokens, or with per-prompt limits, limits spread over
    1..min(512, the longest limit) so that the batch shrinks through every width the timed call will decode
    at. The native engine compiles its kernels once per process, at the first widths and split counts it
    sees: a cost of the first call, as vLLM's compilation is of its start, not of every rollout. With limits
    the warm-up keeps the timed call's `max_new_tokens`, so its cache has the same capacity per row and the
    decode attention the same key splits at each width (a shorter cache gave fewer splits at the narrow widths,
    and the timed call compiled the split merge for the others)."""
    warm = replace(sampling, max_new_tokens=8, max_new_tokens_per_prompt=())
    if sampling.max_new_tokens_per_prompt:
        n, top = len(prompts), min(512, sampling.max_new_tokens)
        spread = tuple(1 + (top - 1) * i // max(1, n - 1) for i in range(n))
        warm = replace(sampling, max_new_tokens_per_prompt=spread)
    engine.generate(prompts, warm)


def timed_call(engine, prompts, sampling, device) -> tuple[object, float, float]:
    """(output, wall seconds, process CPU seconds) of one generate call, CUDA-synchronised."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, cpu_start = synced(device), time.process_time()
    out = engine.generate(prompts, sampling)
    return out, synced(device) - start, time.process_time() - cpu_start


def first_tokens(engine, prompts) -> torch.Tensor:
    return engine.generate(prompts[:32], SamplingParams(temperature=0.0, max_new_tokens=1)).response_ids[:, 0]


class NativeRun:
    """One native backend of the run: its engine, warmed up once (`warm_up`), its timed `generate` calls
    (`timed`, one per round of `--repeats`) and, from them, its result (`finish`)."""

    def __init__(
        self, name, shape, weights, prompts, sampling, args, device, shim_overhead=False, **engine_kw
    ):
        from engine.rollout import native

        self.name, self.prompts, self.sampling, self.args, self.device = name, prompts, sampling, args, device
        self.engine = native.NativeRollout(
            shape, device, args.max_num_seqs, cuda_graphs=False if args.no_cuda_graphs else None, **engine_kw
        )
        self.engine.set_weights(weights)
        self.patch = contextlib.nullcontext
        if shim_overhead:  # the megatron CPU shims' TorchFunctionMode stays active in the decode loop
            self.patch = lambda: _patched(native, "no_shim_overhead", contextlib.nullcontext)
        self.calls: list[tuple[float, float, float | None]] = []  # (seconds, CPU seconds, peak GB)
        with self.patch():
            warm_up(self.engine, prompts, sampling)
        _free_cached(device)

    def timed(self) -> None:
        with self.patch():
            self.out, seconds, cpu_seconds = timed_call(self.engine, self.prompts, self.sampling, self.device)
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        self.calls.append((seconds, cpu_seconds, peak))
        e = self.engine
        self.stats = dict(e.last_stats)
        by_width = sorted(e.last_stats_by_width.items())
        self.stats["decode_ms_per_step_by_width"] = {
            w: round(1e3 * sec / steps, 3) for w, (steps, sec) in by_width
        }
        self.stats["decode_steps_by_width"] = {w: steps for w, (steps, _) in by_width}
        captured = e.graphs.capture_seconds if e.graphs is not None else {}
        self.stats["capture_ms_by_width"] = {w: round(1e3 * sec, 1) for w, sec in sorted(captured.items())}
        self.stats["decode_ms_per_step_by_width_without_capture"] = {
            w: round(1e3 * (sec - captured.get(w, 0.0)) / steps, 3) for w, (steps, sec) in by_width
        }
        _free_cached(self.device)

    def finish(self) -> tuple[dict, torch.Tensor]:
        """(result: the median call's seconds, every call's in `seconds_each`, the last call's engine stats;
        the first greedy tokens), then the engine's memory freed."""
        with self.patch():
            greedy = first_tokens(self.engine, self.prompts)
        seconds = statistics.median(c[0] for c in self.calls)
        cpu = statistics.median(c[1] for c in self.calls)
        result = _result(self.out, seconds, self.device, cpu, peak=False)
        if self.device.type == "cuda":
            result["peak_memory_gb"] = round(max(c[2] for c in self.calls), 2)
        if len(self.calls) > 1:
            result["seconds_each"] = [round(c[0], 3) for c in self.calls]
        result["engine_stats"] = self.stats
        if self.stats.get("slot_steps"):  # generated tokens per decoded slot (finished, filler slots: waste)
            slots = self.stats["slot_steps"] + self.stats["slots"]
            result["decode_occupancy"] = round(result["tokens"] / slots, 4)
        if self.args.profile and self.name != "native_with_shim_overhead":
            args = (self.engine, self.prompts, self.sampling, self.device, self.args, self.name)
            result["profile"] = profile_generate(*args)
        self.engine.release()
        _free_cached(self.device)
        return result, greedy


def _free_cached(device: torch.device) -> None:
    """The next engine's KV budget (a fraction of free memory) must not see this one's cached blocks."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile_generate(engine, prompts, sampling, device, args, name: str) -> dict:
    """One more `generate` under torch.profiler: kernel table file + time by kernel kind."""
    from profiling import kernel_table

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(args.profile, exist_ok=True)
    path = os.path.join(args.profile, f"profile_{name}_{args.preset}.txt")
    with torch.profiler.profile(activities=activities) as prof:
        start = synced(device)
        engine.generate(prompts, sampling)
        wall = synced(device) - start
    what = f"one {name} generate ({len(prompts)} x {sampling.max_new_tokens} new tokens)"
    return kernel_table(prof, device, path, wall, what=what)


def run_vllm(shape, weights, prompts, sampling, args, device, reference) -> dict:
    if device.type != "cuda":
        return {"skipped": "vLLM runs on CUDA only"}
    try:
        from engine.rollout.vllm_backend import VllmRollout
    except ImportError as err:
        return {"skipped": str(err)}
    start = time.perf_counter()
    try:
        engine = VllmRollout(
            shape,
            device,
            1,
            max_num_seqs=args.max_num_seqs,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
    except ImportError as err:
        return {"skipped": str(err)}
    engine_start = time.perf_counter() - start
    engine.set_weights(weights)
    out, seconds, _ = timed_generate(engine, prompts, sampling, device)
    result = _result(out, seconds, device, peak=False)
    result.update(engine_start_s=round(engine_start, 1), engine_stats=dict(engine.last_stats))
    result["v2_model_runner"] = engine.uses_v2_model_runner
    result["greedy_agree_first_token"] = _agree(first_tokens(engine, prompts), reference)
    return result


def run_transformers(shape, weights, prompts, sampling, device, reference) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.rollout.vllm_backend import write_hf_config

    config = AutoConfig.from_pretrained(write_hf_config(shape))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=shape.dtype, attn_implementation="sdpa").eval()
    state = {}
    for name, shard in weights.params.items():
        rule, layer = match_rule(name)
        state.update(zip(hf_names(rule, layer), hf_from_shards(rule, [shard], shape)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ids = torch.tensor(prompts, device=device)

    def generate(new: int, do_sample: bool = True) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=do_sample,
                temperature=sampling.temperature if do_sample else None,
                top_k=0 if do_sample else None,
                top_p=1.0 if do_sample else None,
                max_new_tokens=new,
                min_new_tokens=new,
                eos_token_id=None,
                pad_token_id=0,
            )

    generate(8)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, cpu_start = synced(device), time.process_time()
    out = generate(sampling.max_new_tokens)
    seconds, cpu_seconds = synced(device) - start, time.process_time() - cpu_start
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    result = _tokens_result(tokens, seconds, device, cpu_seconds)
    first = generate(1, do_sample=False)[:32, -1].cpu()
    result["greedy_agree_first_token"] = _agree(first, reference)
    return result


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _agree(tokens: torch.Tensor, reference: torch.Tensor) -> float:
    return round((tokens.cpu() == reference.cpu()).float().mean().item(), 3)


def _result(
    out, seconds: float, device: torch.device, cpu_seconds: float | None = None, peak: bool = True
) -> dict:
    return _tokens_result(int(out.response_mask.sum()), seconds, device, cpu_seconds, peak)


def _tokens_result(
    tokens: int, seconds: float, device, cpu_seconds: float | None = None, peak: bool = True
) -> dict:
    """Throughput; on CPU also per process CPU second (steadier than wall time on a shared machine)."""
    result = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds)}
    if device.type == "cpu" and cpu_seconds:
        result["tokens_per_cpu_s"] = round(tokens / cpu_seconds)
    if peak and device.type == "cuda":
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return result


def main() -> None:
    args = parse_args()
    tiny = args.preset in TINY
    args.prompts = args.prompts or (64 if tiny else 512)
    args.prompt_len = args.prompt_len or (32 if tiny else 256)
    args.new_tokens = args.new_tokens or (64 if tiny else 512)
    args.max_num_seqs = args.max_num_seqs or args.prompts * args.n
    wanted = args.backends.split(",")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    groups = init_distributed(ParallelDims(world_size=1), device_type)  # vLLM joins this world
    device = groups.device
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    shape = model_shape(args.preset)
    weights = random_rollout_weights(shape, device, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, shape.vocab_size, (args.prompts, args.prompt_len), generator=gen).tolist()
    lengths = response_lengths(args.lengths, args.prompts, args.new_tokens, args.seed)
    sampling = SamplingParams(
        n=args.n,
        temperature=1.0,
        max_new_tokens=args.new_tokens,
        max_new_tokens_per_prompt=tuple(lengths) if args.lengths != "fixed" else (),
        ignore_eos=True,
        seed=args.seed,
        log_probs=not args.no_log_probs,
    )
    params = sum(t.numel() for t in weights.params.values())
    report = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(shape.dtype).removeprefix("torch."),
        "parameters": params,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "n": args.n,
        "lengths": {"kind": args.lengths, **describe(lengths, args.new_tokens)},
        "max_num_seqs": args.max_num_seqs,
        "temperature": 1.0,
        "log_probs": not args.no_log_probs,
        "results": {},
    }
    results = report["results"]
    runs, common = [], (shape, weights, prompts, sampling, args, device)
    if wanted:  # native is every other backend's reference
        runs.append(NativeRun("native", *common))
        if args.compare_shims and device.type == "cpu":
            runs.append(NativeRun("native_with_shim_overhead", *common, shim_overhead=True))
    if "native_contiguous" in wanted:  # the KV layout before pages: one longest-row region per slot
        runs.append(NativeRun("native_contiguous", *common, paged_kv=False))
    variants = {**VARIANTS, "native_tiles": args.attention_tiles}  # (its kernels from --attention-tiles)
    skipped = [name for name in variants if name in wanted and device.type != "cuda"]
    for name, kernels in variants.items():
        if name in wanted and name not in skipped:
            runs.append(NativeRun(name, *common, kernels=kernels))
    for r in range(args.repeats):  # each round starts with the next backend
        for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
            run.timed()
    reference = None
    for run in runs:
        results[run.name], greedy = run.finish()
        if reference is None:
            reference = greedy
        elif run.name != "native_with_shim_overhead":
            results[run.name]["greedy_agree_first_token"] = _agree(greedy, reference)
    for name in skipped:
        results[name] = {"skipped": "the fast kernels apply on CUDA only: same as native here"}
    if device.type == "cuda":
        torch.cuda.empty_cache()  # vLLM checks free memory against --gpu-memory-utilization at start
    if "vllm" in wanted:
        try:
            results["vllm"] = run_vllm(shape, weights, prompts, sampling, args, device, reference)
        except Exception as err:  # still measure and report the other backends
            traceback.print_exc()
            results["vllm"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
    if "transformers" in wanted and args.n > 1:
        results["transformers"] = {"skipped": "the bench's generate call draws one sample per prompt"}
    elif "transformers" in wanted and sampling.max_new_tokens_per_prompt:
        results["transformers"] = {"skipped": "generate has no per-row length limit"}
    elif "transformers" in wanted and shape.moe is not None:
        results["transformers"] = {"skipped": "MoE: the bench maps weights to per-expert HF names only"}
    elif "transformers" in wanted:
        results["transformers"] = run_transformers(shape, weights, prompts, sampling, device, reference)
    if device.type == "cuda" and args.preset not in TINY and dense(args.preset):
        rows = [n for n in lengths for _ in range(args.n)]
        add_rooflines(report, results, args.preset, args.prompt_len, rows, torch.cuda.get_device_name(device))
    key = "tokens_per_cpu_s" if device.type == "cpu" else "tokens_per_s"  # CPU: steadier on a shared machine
    base = results.get("transformers", {}).get(key)
    for name, r in results.items():
        if base and key in r and name != "transformers":
            r["speedup_vs_transformers"] = round(r[key] / base, 2)
    if device.type == "cuda":  # every Triton kernel launched: registers, spills, programs per SM
        report["triton_kernels"] = launched_kernels()
        # each decode attention variant's ladder of register caps and the caps its launches took
        report["attention_register_caps"] = triton_decode.occupancy_caps()
    line = json.dumps(report)
    print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    destroy_distributed()


if __name__ == "__main__":
    main()
