"""torchrun script of tests/engine/test_rollout_tp.py: world size 2 (gloo, CPU), every check in one launch.

    torchrun --nproc_per_node=2 tests/engine/rollout_tp_script.py ROOT [cpu|cuda]   (ROOT/<family>: hf_tiny)

For the Qwen2 (tied, QKV bias) and Llama (untied, Llama-3 RoPE) tiny models, loaded at a TP=2 training layout
with `build_and_load`, and for rollout.tp in (2, 1) via `HybridEngine(..., rollout_tp=...)`:
- greedy rollout (engine/step/rollout.py: at rollout.tp=1 each rank generates half the prompts and the
  halves are gathered) equals transformers' greedy generation token for token;
- sampled responses (n=2, T=0.7, top-p, a stop token): their rollout log-probs equal the actor's training
  forward (MegatronRole.run + log_prob_fn at the same temperature) within LOGP_TOL (float32);
- an episode's next turn continued from the kept KV cache gives a full prefill's tokens (log-probs within
  LOGP_TOL);
- both ranks hold identical outputs; asked for no log-probs (SamplingParams.log_probs=False, what
  rollout.log_probs=false asks), the same responses come back with log_probs None, exchange included;
- the vLLM weight loader (engine/rollout/vllm_weights.py) fills vLLM-shaped parameters from the rollout shards
  exactly as vLLM would shard the full HF tensors (vocab 101 pads differently in vLLM: rows are exchanged).
On cuda (2 GPUs, NCCL) the same checks run with the native engine's CUDA-graph decode. Rank 0 prints
`RESULT {json}` lines.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from engine.models.hf import HFCheckpoint
from engine.roles.dynamic_batch import MicroBatcher
from engine.roles.policy import MegatronRole
from engine.rollout.base import SamplingParams
from engine.rollout.native import NativeRollout
from engine.rollout.vllm_weights import load_rollout_weights, vllm_vocab_rows
from engine.step.batch import build_experience
from engine.step.losses import log_prob_fn
from engine.step.rollout import rollout_replica
from engine.tools.parity import build_and_load
from parallel.dims import ParallelDims
from parallel.hybrid_engine import HybridEngine
from parallel.state import init_distributed

DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cpu"
# float32; measured <= 1e-5 on CPU (training at TP=2 sums in another order than the rollout)
LOGP_TOL = 1e-4 if DEVICE == "cpu" else 5e-4
NEW = 10
PAD = 0


def expected_vllm_params(ckpt: dict[str, torch.Tensor], vocab: int, tp: int, rank: int) -> dict:
    """vLLM's rank-`rank` parameters for full HF tensors `ckpt`, by vLLM's own sharding rules (QKVParallel:
    [q; k; v] of the rank's heads; MergedColumnParallel: [gate; up]; RowParallel: input columns; vocab
    padded to 64 then split, padding rows zero; FusedMoE, expert parallelism off: its RoutedExperts submodule's
    `mlp.experts.routed_experts.w13_weight` stacks per expert [gate; up] rows narrowed to the rank's I/tp
    (`_load_w13`: w1 first, w3 second), `w2_weight` the down projections' input columns (`_load_w2`))."""
    out = {}
    experts = [n for n in ckpt if re.search(r"\.mlp\.experts\.\d+\.gate_proj\.weight$", n)]
    for prefix in sorted({n.split(".mlp.experts.")[0] + ".mlp.experts" for n in experts}):
        count = sum(n.startswith(prefix + ".") for n in experts)
        w = [
            {p: ckpt[f"{prefix}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}
            for e in range(count)
        ]
        out[prefix + ".routed_experts.w13_weight"] = torch.stack(
            [torch.cat([x["gate_proj"].chunk(tp)[rank], x["up_proj"].chunk(tp)[rank]]) for x in w]
        )
        out[prefix + ".routed_experts.w2_weight"] = torch.stack(
            [x["down_proj"].chunk(tp, dim=1)[rank] for x in w]
        )
    for name, full in ckpt.items():
        if re.search(r"\.mlp\.experts\.\d+\.", name):
            continue
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            parts = [ckpt[name.replace("q_proj", p)].chunk(tp)[rank] for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
        elif ".gate_proj." in name:
            parts = [ckpt[name.replace("gate_proj", p)].chunk(tp)[rank] for p in ("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(parts)
        elif ".o_proj." in name or ".down_proj." in name:
            out[name] = full.chunk(tp, dim=1)[rank]
        elif "embed_tokens" in name or "lm_head" in name:
            rows = vllm_vocab_rows(vocab, tp)
            shard = torch.zeros(rows, full.shape[1], dtype=full.dtype)
            real = full[rank * rows : (rank + 1) * rows]
            shard[: real.shape[0]] = real
            out[name] = shard
        else:
            out[name] = full
    return out


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    with HFCheckpoint(path) as ckpt:
        return {name: ckpt.tensor(name).clone() for name in ckpt.file_of}


def hf_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def actor_log_probs(actor: MegatronRole, prompts, out, n: int, temperature: float) -> torch.Tensor:
    """The training forward's log-probs of the rollout's responses (rows, NEW)."""
    exp = build_experience(prompts, out.response_ids, out.response_mask, list(range(len(prompts))), n, PAD)
    mbs = MicroBatcher(4, 0, 1, actor.groups.device)(exp, torch.arange(exp.num_rows))
    outs = actor.run(mbs, log_prob_fn, forward_only=True, temperature=temperature)
    return torch.cat([o["log_probs"] for o in outs]).cpu()


def same_on_all_ranks(t: torch.Tensor) -> bool:
    t = t.to(DEVICE)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(parts[0], p) for p in parts)


def check_continued_turn(engine: NativeRollout, prompts: list[list[int]]) -> float:
    """An episode's next turn continued from the kept KV cache (engine/rollout/native.py
    `generate_continued`, the TP collectives of `prefill_continued`) gives a full prefill's tokens; returns
    the largest log-prob difference."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    with engine.hold(max_len=max(map(len, prompts)) + 2 * NEW + 3):
        first = engine.generate(prompts, greedy)
        turn2 = [
            p + r + [5] * (1 + i % 3) for i, (p, r) in enumerate(zip(prompts, first.response_ids.tolist()))
        ]
        cont = engine.generate_continued(turn2, greedy, list(range(len(prompts))))
        continued = engine.last_stats["continued_rows"]
    full = engine.generate(turn2, greedy)
    assert continued == len(prompts) and torch.equal(cont.response_ids, full.response_ids), (continued,)
    return (cont.log_probs - full.log_probs).abs().max().item()


def check_family(groups, family: str, path: str) -> None:
    start = time.perf_counter()
    chunks, shape = build_and_load(path, groups)  # training layout TP=2
    actor = MegatronRole(chunks, groups, shape, None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, shape.vocab_size, (n,), generator=g).tolist() for n in (3, 8, 1, 6, 11)]
    reference = hf_greedy(path, prompts)
    ckpt = hf_tensors(path)
    stop = reference[0][4]  # a token greedy produces: sampled rows stop on it now and then
    for rollout_tp in (2, 1):
        transition = HybridEngine(
            actor.chunks, groups, shape.num_layers, shape.tie_embeddings, rollout_tp=rollout_tp
        )
        weights = transition.to_rollout()
        engine = NativeRollout(shape, groups.device, max_num_seqs=4, pad_id=PAD)
        engine.set_weights(weights)
        greedy = rollout_replica(
            engine, weights, prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW)
        )
        assert greedy.response_ids.tolist() == reference, (
            family,
            rollout_tp,
            greedy.response_ids.tolist(),
            reference,
        )
        greedy_diff = (actor_log_probs(actor, prompts, greedy, 1, 1.0) - greedy.log_probs).abs().max().item()
        sampling = SamplingParams(
            n=2, temperature=0.7, top_p=0.95, max_new_tokens=NEW, stop_token_ids=(stop,), seed=1234
        )
        sampled = rollout_replica(engine, weights, prompts, sampling)
        train = actor_log_probs(actor, prompts, sampled, 2, 0.7)
        sampled_diff = ((train - sampled.log_probs) * sampled.response_mask).abs().max().item()
        assert greedy_diff < LOGP_TOL and sampled_diff < LOGP_TOL, (
            family,
            rollout_tp,
            greedy_diff,
            sampled_diff,
        )
        assert same_on_all_ranks(sampled.response_ids) and same_on_all_ranks(sampled.log_probs)
        # without log-probs (rollout.log_probs=false): the same responses, and none exchanged or returned
        bare = rollout_replica(engine, weights, prompts, replace(sampling, log_probs=False))
        assert bare.log_probs is None and torch.equal(bare.response_ids, sampled.response_ids)
        num_stopped = sampled.finish_reasons.count("stop")
        cont_diff = check_continued_turn(engine, prompts[:4])

        # vLLM's parameters, as vLLM shards them, filled from the rollout shards
        vocab = shape.vocab_size
        want = expected_vllm_params(ckpt, vocab, rollout_tp, weights.tp_rank)
        fake = {name: torch.full_like(t, float("nan"), device=groups.device) for name, t in want.items()}
        stats = load_rollout_weights(
            fake, weights.params, shape, weights.tp_rank, rollout_tp, weights.tp_group
        )
        bad = [name for name in want if not torch.equal(fake[name].cpu(), want[name])]
        assert not bad, (family, rollout_tp, bad)
        transition.to_train()
        if groups.rank == 0:
            print(
                "RESULT "
                + json.dumps(
                    {
                        "family": family,
                        "rollout_tp": rollout_tp,
                        "greedy_equal": True,
                        "greedy_logp_diff": greedy_diff,
                        "sampled_logp_diff": sampled_diff,
                        "stopped_rows": num_stopped,
                        "continued_logp_diff": cont_diff,
                        "vllm_tensors": stats["tensors"],
                        "vllm_vocab_bytes_received": stats["bytes_received"],
                        "elapsed_s": round(time.perf_counter() - start, 2),
                    }
                ),
                flush=True,
            )


def main(root: str) -> None:
    groups = init_distributed(ParallelDims(world_size=2, tp=2), DEVICE)
    for family in ("qwen2", "llama"):
        check_family(groups, family, f"{root}/{family}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
