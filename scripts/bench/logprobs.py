"""The actor's output head alone: per-token log-probs + entropy of response tokens, the actor's loss on them
(PPO, token-mean, entropy bonus 0.01: engine/step/losses.py) and the backward, three ways, same inputs, one
process, one run: the fused chunked head (engine/models/fused_logprobs.py), the same head computing the loss's
gradient in its forward (`one_pass`: no logits recomputed in the backward; the trainer's default for token-local
losses), and the unfused path the fused head replaced (bf16 logits of every position from the output layer, an
fp32 copy of the response window, megatron's vocab_parallel_cross_entropy and
engine/models/logprobs.token_entropy).

    python scripts/bench/logprobs.py --preset qwen2_5_0_5b --rows 21        # Qwen2.5-0.5B head, one GPU
    python scripts/bench/logprobs.py --hidden 1536 --vocab 151936           # Qwen2.5-1.5B's head, by size
    python scripts/bench/logprobs.py --rows 4 --prompt-len 8 --response-len 16 --hidden 32 --vocab 512  # CPU

Prints one JSON object: per method the median seconds of forward + loss + backward (CUDA-synchronised), peak
memory above the inputs (GPU), and the largest differences of log-probs / entropies / gradients against the
fused head (`max_diff`: the unfused path; `one_pass_max_diff`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402
from presets import model_preset  # noqa: E402

from engine.config import AlgorithmConfig  # noqa: E402
from engine.models.fused_logprobs import linear_log_probs, linear_log_probs_one_pass  # noqa: E402
from engine.models.logprobs import token_entropy  # noqa: E402
from engine.roles.policy import ResponseStats  # noqa: E402
from engine.step.losses import make_actor_loss  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.state import init_distributed  # noqa: E402


def unfused(h_sbh, w, targets, prompt_len, group, loss):
    """What MegatronRole ran before: logits of every position, fp32 window, CE + entropy on it."""
    logits = (h_sbh @ w.t()).transpose(0, 1)  # (b, s, vocab) like GPTModel's output
    window = logits[:, prompt_len - 1 : -1].float()
    ent = token_entropy(window, group)  # first: the cross entropy overwrites its input
    logp = -vocab_parallel_cross_entropy(window.contiguous(), targets.contiguous())
    return logp, ent, 0.0


def fused(h_sbh, w, targets, prompt_len, group, loss):
    h = h_sbh.transpose(0, 1)[:, prompt_len - 1 : -1]
    return (*linear_log_probs(h, w, targets, vocab_size=w.shape[0], tp_group=None), 0.0)


def one_pass(h_sbh, w, targets, prompt_len, group, loss):
    h = h_sbh.transpose(0, 1)[:, prompt_len - 1 : -1].reshape(-1, h_sbh.shape[-1])
    grads = loss.fn.token_grads(loss.mb, None)
    anchor, logp, ent = linear_log_probs_one_pass(h, w, targets.reshape(-1), grads, vocab_size=w.shape[0])
    return logp.view(targets.shape), ent.view(targets.shape), anchor


@dataclasses.dataclass
class Loss:
    """The actor's loss over the micro-batch's tokens (token-mean) and its micro-batch (mask, advantages, old
    log-probs)."""

    fn: Callable
    mb: dict


def timed(fn, args, iters, device):
    h, w = (a.detach().clone().requires_grad_() for a in args[:2])
    times, peak = [], 0
    for i in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        logp, ent, anchor = fn(h, w, *args[2:])
        loss = args[-1]
        (loss.fn(ResponseStats(logp, ent), loss.mb)[0] + anchor).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        if i:  # the first call compiles / warms up
            times.append(time.perf_counter() - t0)
        grads = (h.grad.clone(), w.grad.clone())
        h.grad = w.grad = None
    return statistics.median(times), peak, logp.detach(), ent.detach(), grads


def max_diff(a, b) -> dict[str, float]:
    """Largest differences of two `timed` results' log-probs, entropies, and gradients (relative to the
    largest entry of `a`'s)."""
    return {
        "logp": (a[2] - b[2]).abs().max().item(),
        "entropy": (a[3] - b[3]).abs().max().item(),
        "grad_hidden_rel": ((a[4][0] - b[4][0]).abs().max() / a[4][0].abs().max()).item(),
        "grad_weight_rel": ((a[4][1] - b[4][1]).abs().max() / a[4][1].abs().max()).item(),
    }


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
    shape = (args.rows, args.response_len)
    loss = Loss(
        make_actor_loss(
            AlgorithmConfig(entropy_coef=0.01),
            float(shape[0] * shape[1]),
            kl_ref=False,
            rollout_log_probs=False,
        ),
        dict(
            response_mask=torch.ones(shape, dtype=torch.bool, device=device),
            advantages=torch.randn(shape, device=device, generator=g),
            old_log_probs=-torch.rand(shape, device=device, generator=g)
            * 12,  # near log(1 / vocab): some clip
        ),
    )
    out = {
        "rows": args.rows,
        "tokens": args.rows * args.response_len,
        "hidden": args.hidden,
        "vocab": args.vocab,
    }
    results = {}
    for name, fn in (("unfused", unfused), ("fused", fused), ("one_pass", one_pass)):
        try:
            results[name] = timed(fn, (h, w, targets, args.prompt_len, group, loss), args.iters, device)
            sec, peak = results[name][:2]
            out[name] = {"seconds": sec, "peak_extra_gb": peak / 1e9 if device.type == "cuda" else None}
        except torch.OutOfMemoryError as err:
            out[name] = {"error": f"out of memory: {str(err)[:200]}"}
    two = results.get("fused")
    if two and "unfused" in results:  # speedup: the fused head's over the unfused path
        out["max_diff"], out["speedup"] = (
            max_diff(results["unfused"], two),
            results["unfused"][0] / two[0],
        )
    if two and "one_pass" in results:  # one_pass_speedup: the one-pass head's over the fused (two-pass) one
        one = results["one_pass"]
        out["one_pass_max_diff"], out["one_pass_speedup"] = max_diff(one, two), two[0] / one[0]
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
