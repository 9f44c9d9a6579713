"""The actor's output head alone: per-token log-probs + entropy of response tokens and their backward, the
fused chunked head (engine/models/fused_logprobs.py) versus the unfused path it replaced (bf16 logits of
every position from the output layer, an fp32 copy of the response window, megatron's
vocab_parallel_cross_entropy and engine/models/logprobs.token_entropy), same inputs, one process, one run.

    python scripts/bench/logprobs.py --preset qwen2_5_0_5b --rows 21        # Qwen2.5-0.5B head, one GPU
    python scripts/bench/logprobs.py --hidden 1536 --vocab 151936           # Qwen2.5-1.5B's head, by size
    python scripts/bench/logprobs.py --rows 4 --prompt-len 8 --response-len 16 --hidden 32 --vocab 512  # CPU

Prints one JSON object: per method the median seconds of forward + backward (CUDA-synchronised), peak memory
above the inputs (GPU), and the largest differences of log-probs / entropies / gradients between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402
from presets import model_preset  # noqa: E402

from engine.models.fused_logprobs import linear_log_probs  # noqa: E402
from engine.models.logprobs import token_entropy  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.state import init_distributed  # noqa: E402


def unfused(h_sbh, w, targets, prompt_len, group):
    """What MegatronRole ran before: logits of every position, fp32 window, CE + entropy on it."""
    logits = (h_sbh @ w.t()).transpose(0, 1)  # (b, s, vocab) like GPTModel's output
    window = logits[:, prompt_len - 1 : -1].float()
    ent = token_entropy(window, group)  # first: the cross entropy overwrites its input
    logp = -vocab_parallel_cross_entropy(window.contiguous(), targets.contiguous())
    return logp, ent


def fused(h_sbh, w, targets, prompt_len, group):
    h = h_sbh.transpose(0, 1)[:, prompt_len - 1 : -1]
    return linear_log_probs(h, w, targets, vocab_size=w.shape[0], tp_group=None)


def timed(fn, args, iters, device):
    h, w = (a.detach().clone().requires_grad_() for a in args[:2])
    times, peak = [], 0
    for i in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        logp, ent = fn(h, w, *args[2:])
        (logp.sum() + 0.01 * ent.sum()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        if i:  # the first call compiles / warms up
            times.append(time.perf_counter() - t0)
        grads = (h.grad.clone(), w.grad.clone())
        h.grad = w.grad = None
    return statistics.median(times), peak, logp.detach(), ent.detach(), grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16, help="sequences in the micro-batch")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--preset", help="conf/model/<preset>.yaml: takes --hidden and --vocab (if set) from it")
    args = ap.parse_args()
    if args.preset:
        model = model_preset(args.preset)
        args.hidden, args.vocab = model["hidden_size"], model.get("vocab_size", args.vocab)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29561"),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)
    group = init_distributed(ParallelDims(world_size=1), device.type).tp  # megatron's CE needs its TP group
    g = torch.Generator(device=device).manual_seed(0)
    s = args.prompt_len + args.response_len
    h = torch.randn(s, args.rows, args.hidden, device=device, generator=g).to(dtype)
    w = (torch.randn(args.vocab, args.hidden, device=device, generator=g) * 0.02).to(dtype)
    targets = torch.randint(0, args.vocab, (args.rows, args.response_len), device=device, generator=g)
    out = {
        "rows": args.rows,
        "tokens": args.rows * args.response_len,
        "hidden": args.hidden,
        "vocab": args.vocab,
    }
    results = {}
    for name, fn in (("unfused", unfused), ("fused", fused)):
        try:
            results[name] = timed(fn, (h, w, targets, args.prompt_len, group), args.iters, device)
            sec, peak = results[name][:2]
            out[name] = {"seconds": sec, "peak_extra_gb": peak / 1e9 if device.type == "cuda" else None}
        except torch.OutOfMemoryError as err:
            out[name] = {"error": f"out of memory: {str(err)[:200]}"}
    if "unfused" in results and "fused" in results:
        a, b = results["unfused"], results["fused"]
        out["max_diff"] = {
            "logp": (a[2] - b[2]).abs().max().item(),
            "entropy": (a[3] - b[3]).abs().max().item(),
            "grad_hidden_rel": ((a[4][0] - b[4][0]).abs().max() / a[4][0].abs().max()).item(),
            "grad_weight_rel": ((a[4][1] - b[4][1]).abs().max() / a[4][1].abs().max()).item(),
        }
        out["speedup"] = a[0] / b[0]
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
