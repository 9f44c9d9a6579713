"""Sharded GPTModel parity, 4 CPU ranks (gloo): logits and gradients of the engine's training path
(MegatronRole: DDP + megatron's forward/backward schedule) at several layouts versus one TP=1/PP=1 model
with the same weights. Launched by tests/parallel/test_model_parity.py; prints one line per layout.

Layouts (world 4): tp2 pp2; tp1 pp2 vpp2 dp2 (tied embeddings); tp2 dp2 with sequence parallelism; and a
tiny mixture-of-experts model (4 experts, top-2, a gated shared expert) at tp2 dp2 ep2, pp2 dp2 ep2 and
tp2 pp2 ep2 (experts split over the TP pair; TP with sequence parallelism, as megatron's MoE requires) against the same MoE model at EP=1 (no aux/z loss: those are
statistics of a micro-batch, which the reference's one forward does not split the same way). Each
layout runs both output heads of MegatronRole: "logits" and the fused "response" head
(engine/models/fused_logprobs.py), the latter twice: the loss's gradient through the head's backward, and
computed in the head's forward from the loss's per-token gradient (`token_grads`: the one-pass head), with
temperature 0.8 and a loss of log-likelihood plus an entropy bonus.
Tolerance: float32, |diff| <= 2e-5 on logits, log-probs and entropies, relative 1e-4 on gradients.
The sharded layouts run with megatron's global process groups destroyed: every group comes from the engine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from engine.config import ModelConfig, MoEConfig, OptimConfig
from engine.models.builder import build_gpt_chunks, resolve_shape
from engine.models.logprobs import token_entropy, token_log_probs
from engine.roles.policy import MegatronRole
from parallel.dims import ParallelDims
from parallel.hybrid_check import megatron_shard
from parallel.layout import TrainLayout
from parallel.rollout_weights import global_param_names, partition_kind
from parallel.state import destroy_model_parallel_groups, init_distributed

VOCAB, SEQ, ROWS, LAYERS = 40, 12, 8, 4
TEMPERATURE, ENTROPY_COEF = 0.8, 0.1


MOE = MoEConfig(
    num_experts=4, top_k=2, ffn_hidden_size=16, shared_expert_ffn_hidden_size=24, shared_expert_gate=True
)


def model_cfg(tied: bool, moe: bool = False) -> ModelConfig:
    return ModelConfig(
        moe=MOE if moe else MoEConfig(),
        num_layers=LAYERS,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        qkv_bias=True,
        tie_embeddings=tied,
        max_position_embeddings=64,
    )


def batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    weights = torch.rand(ROWS, SEQ - 1, generator=g)
    return tokens, weights


def reference(tied: bool, moe: bool = False):
    """Full model (TP=1, PP=1, EP=1): state, logits, log-probs, entropies and grads of the loss on the whole batch."""
    dims = ParallelDims(world_size=4)
    groups = init_distributed(dims, "cpu", seed=0)
    shape = resolve_shape(model_cfg(tied, moe), VOCAB, 1)
    torch.manual_seed(1234)
    (model,) = build_gpt_chunks(shape, groups, init_std=0.05, recompute=False)
    tokens, weights = batch()
    logits = model(tokens, torch.arange(SEQ).expand(ROWS, SEQ), None).float() / TEMPERATURE
    ent = token_entropy(logits[:, :-1], groups.tp)
    logp = token_log_probs(logits[:, :-1], tokens[:, 1:], groups.tp)
    loss_of(logp, ent, weights).backward()
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    destroy_model_parallel_groups()
    return shape, state, grads, logits.detach() * TEMPERATURE, logp.detach(), ent.detach()


def loss_of(logp: torch.Tensor, ent: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Weighted log-likelihood plus an entropy bonus, over the whole batch."""
    return -((logp + ENTROPY_COEF * ent) * w).sum() / (ROWS * (SEQ - 1))


def sharded(name: str, dims: ParallelDims, tied: bool, ref, moe: bool = False) -> None:
    """Both output heads of MegatronRole at `dims`: "logits" (vocab-parallel logits; the loss computes
    log-probs and entropy from them) and "response" (the fused head), against the reference."""
    _, state, grads, ref_logits, ref_logp, ref_ent = ref
    groups = init_distributed(dims, "cpu", seed=0)
    # From here megatron's global groups are gone: building, DDP, the optimizer and the schedule must run on
    # the groups the engine passes (ProcessGroups). The sequence-parallel gather buffer is not a group.
    parallel_state.destroy_model_parallel()
    parallel_state._set_global_memory_buffer()
    shape = resolve_shape(model_cfg(tied, moe), VOCAB, dims.tp)
    offset = groups.expert_offset(MOE.num_experts) if moe else 0
    layout = TrainLayout(tp=dims.tp, pp=dims.pp, dp=dims.dp, vpp=dims.vpp)
    tokens, weights = batch()
    rows = torch.arange(ROWS).chunk(dims.dp)[groups.dp_rank]  # each DP replica takes its share
    positions = torch.arange(SEQ - 1)
    mbs = [
        {
            "tokens": tokens[r],
            "positions": torch.arange(SEQ).expand(len(r), SEQ),
            "response_index": positions.expand(len(r), SEQ - 1),  # every position is "response"
            "w": weights[r],
            "rows": r,
        }
        for r in rows.chunk(2)
    ]

    def logits_loss(logits_local, mb):
        ent = token_entropy(logits_local[:, :-1], groups.tp)
        logp = token_log_probs(logits_local[:, :-1], mb["tokens"][:, 1:], groups.tp)
        parts = [torch.empty_like(logits_local) for _ in range(dims.tp)]
        dist.all_gather(parts, logits_local.detach().contiguous(), group=groups.tp)
        logits = torch.cat(parts, -1) * TEMPERATURE
        return loss_of(logp, ent, mb["w"]), {
            "logits": logits,
            "logp": logp.detach(),
            "ent": ent.detach(),
            "rows": mb["rows"],
        }

    def response_loss(stats, mb):
        logp, ent = stats.log_probs, stats.entropy
        return loss_of(logp, ent, mb["w"]), {"logp": logp.detach(), "ent": ent.detach(), "rows": mb["rows"]}

    def one_pass_loss(stats, mb):
        return response_loss(stats, mb)

    def token_grads(mb, valid):
        """loss_of's gradient per token, over every (row, step) entry in order (no response_valid here)."""
        assert valid is None
        w = mb["w"].reshape(-1) * (-1.0 / (ROWS * (SEQ - 1)))
        return lambda rows, logp, ent: (w[rows], ENTROPY_COEF * w[rows])

    one_pass_loss.token_grads = token_grads  # the one-pass head (`response_token_grads`)
    figures = []
    for head, loss_fn in (("logits", logits_loss), ("response", response_loss), ("one_pass", one_pass_loss)):
        chunks = build_gpt_chunks(shape, groups, init_std=0.05, recompute=False)
        local = global_param_names(chunks, layout.layers(groups.pp_rank, LAYERS), offset)
        for pname, param in local.items():
            src = "embedding.word_embeddings.weight" if pname == "output_layer.weight" and tied else pname
            param.data.copy_(megatron_shard(state[src], partition_kind(pname), dims.tp, groups.tp_rank))
        role = MegatronRole(
            chunks, groups, shape, OptimConfig(), head="logits" if head == "logits" else "response"
        )
        outs = role.run(mbs, loss_fn, forward_only=False, temperature=TEMPERATURE)
        worst = {"logits": 0.0, "logp": 0.0, "ent": 0.0}
        for o in outs:
            if "logits" in o:
                worst["logits"] = max(worst["logits"], _diff(o["logits"][..., :VOCAB], ref_logits[o["rows"]]))
            worst["logp"] = max(worst["logp"], _diff(o["logp"], ref_logp[o["rows"]]))
            worst["ent"] = max(worst["ent"], _diff(o["ent"], ref_ent[o["rows"]]))
        worst_grad = 0.0
        held = global_param_names(role.chunks, layout.layers(groups.pp_rank, LAYERS), offset)
        for pname, param in held.items():
            src = "embedding.word_embeddings.weight" if pname == "output_layer.weight" and tied else pname
            want = megatron_shard(grads[src], partition_kind(pname), dims.tp, groups.tp_rank)
            rel = ((param.main_grad - want).abs().max() / want.abs().max().clamp(min=1e-8)).item()
            worst_grad = max(worst_grad, rel)
        assert max(worst.values()) <= 2e-5, f"{name} {head}: outputs differ {worst}"
        assert worst_grad <= 1e-4, f"{name} {head}: grads differ by {worst_grad} (relative)"
        logits = f"logits={worst['logits']:.2e} " if head == "logits" else ""
        figures.append(
            f"{head}: {logits}logp={worst['logp']:.2e} ent={worst['ent']:.2e} grads={worst_grad:.2e}"
        )
    print(f"PARITY {name} rank={groups.rank} " + "; ".join(figures) + " ok", flush=True)
    destroy_model_parallel_groups()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def main() -> None:
    for tied, layouts in (
        (
            False,
            [
                ("tp2_pp2", ParallelDims(world_size=4, tp=2, pp=2)),
                ("tp2_dp2_sp", ParallelDims(world_size=4, tp=2, sp=True)),
            ],
        ),
        (True, [("tp1_pp2_vpp2_dp2_tied", ParallelDims(world_size=4, pp=2, vpp=2))]),
    ):
        ref = reference(tied)
        for name, dims in layouts:
            sharded(name, dims, tied, ref)
    ref = reference(False, moe=True)
    for name, dims in (
        ("moe_tp2_dp2_ep2_sp", ParallelDims(world_size=4, tp=2, ep=2, sp=True)),
        ("moe_pp2_dp2_ep2", ParallelDims(world_size=4, pp=2, ep=2)),
        ("moe_tp2_pp2_ep2_sp", ParallelDims(world_size=4, tp=2, pp=2, ep=2, sp=True)),
    ):
        sharded(name, dims, False, ref, moe=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
