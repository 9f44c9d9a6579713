"""The layers from CUDA graphs (trainer.cuda_graphs, engine/models/layer_graphs.py) against the same role run
eagerly, on CUDA (marked `gpu`, skipped on CPU; world size 1 in the pytest process, NCCL).

A 3-layer bf16 model (hidden 256, 8 query heads in 2 groups, QKV bias) runs an actor update and a forward-only
log-prob pass over packed micro-batches of 4 equal rows (one shape, captured on its second micro-batch and
replayed from the third) and a last micro-batch of another shape (eager). Each micro-batch holds other tokens,
so a replay that read a stale input or wrote a stale output would be off by O(1).
Tolerances: forward-only log-probs within 1e-6 of eager (the same kernels on the same inputs); the update's
loss and every parameter's float32 `main_grad` within 4x the distance between two eager runs
(FlashAttention-2's backward sums with atomics) plus 1e-3 of the gradient's scale (measured: bitwise equal).
Rows of equal length run FlashAttention-2 and, once an eager call has built its plan, cuDNN's attention (both
captured). The graphs' memory goes back on `release`.
"""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest
import torch

from algorithms.losses import loss_normalizer
from engine.config import AlgorithmConfig, ModelConfig, OptimConfig
from engine.models.builder import build_gpt_chunks, resolve_shape
from engine.roles.dynamic_batch import MicroBatcher
from engine.roles.policy import MegatronRole
from engine.step.batch import build_experience
from engine.step.losses import log_prob_fn, make_actor_loss
from engine.step.update import forward_rows
from parallel.dims import ParallelDims

pytestmark = pytest.mark.gpu

VOCAB, LAYERS, PROMPT, RESPONSE = 512, 3, 24, 40


@pytest.fixture(scope="module")
def cuda_groups():
    from megatron.core import tensor_parallel

    from parallel.state import destroy_distributed, init_distributed

    saved = dict(os.environ)
    groups = init_distributed(ParallelDims(world_size=1), "cuda", seed=3)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    yield groups
    destroy_distributed()
    os.environ.clear()
    os.environ.update(saved)


def _role(groups) -> MegatronRole:
    m = ModelConfig(
        num_layers=LAYERS,
        hidden_size=256,
        ffn_hidden_size=512,
        num_attention_heads=8,
        num_query_groups=2,
        max_position_embeddings=128,
        qkv_bias=True,
    )
    shape = dataclasses.replace(resolve_shape(m, VOCAB, 1), dtype=torch.bfloat16)
    torch.manual_seed(0)
    chunks = build_gpt_chunks(shape, groups, init_std=0.05, recompute=False)
    return MegatronRole(chunks, groups, shape, OptimConfig(lr=1e-3))


def _experience(rows: int, seed: int):
    """`rows` rows of PROMPT + RESPONSE tokens, all as long (the last one shorter: its own micro-batch)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, VOCAB, (rows, PROMPT), generator=gen)
    response_ids = torch.randint(1, VOCAB, (rows, RESPONSE), generator=gen)
    lengths = torch.full((rows,), RESPONSE)
    lengths[-1] = RESPONSE // 2
    mask = (torch.arange(RESPONSE) < lengths[:, None]).float()
    exp = build_experience(prompts.tolist(), response_ids, mask, list(range(rows)), 1, 0)
    exp.tensors.update(
        advantages=torch.randn(rows, RESPONSE, generator=gen) * mask,
        rollout_log_probs=-torch.rand(rows, RESPONSE, generator=gen) * mask,
    )
    return exp, mask


def _update(role: MegatronRole, exp, mask, batcher) -> tuple[float, list[torch.Tensor]]:
    alg = AlgorithmConfig()
    loss_fn = make_actor_loss(alg, loss_normalizer(mask, alg.loss_agg_mode, max_len=RESPONSE), kl_ref=False)
    mbs = batcher(exp, torch.arange(exp.num_rows), ("advantages", "rollout_log_probs"))
    outs = role.run(mbs, loss_fn, forward_only=False)
    loss = sum(float(o["loss"]) for o in outs)
    grads = [p.main_grad.detach().clone() for c in role.chunks for p in c.parameters()]
    return loss, grads


@pytest.mark.parametrize("cudnn_from_call", [None, 1], ids=["flash", "cudnn"])
def test_layers_from_cuda_graphs_match_eager(cuda_groups, cudnn_from_call, monkeypatch):
    from engine.models import packed_attention

    monkeypatch.setattr(packed_attention, "RECURRING", packed_attention.RecurringShapes())
    if cudnn_from_call is not None:  # equal rows through cuDNN from the first (eager) call; captured so
        monkeypatch.setattr(packed_attention, "CUDNN_FROM_CALL", cudnn_from_call)
    role = _role(cuda_groups)
    exp, mask = _experience(4 * 5 + 1, seed=1)
    batcher = MicroBatcher(4, 0, seq_multiple=1, device=cuda_groups.device, pack=True)

    eager_logp = forward_rows(role, exp, log_prob_fn, "log_probs", batcher)
    eager_loss, eager_grads = _update(role, exp, mask, batcher)
    again_loss, again_grads = _update(role, exp, mask, batcher)

    role.use_cuda_graphs()
    graphs = role.layer_graphs
    graph_logp = forward_rows(role, exp, log_prob_fn, "log_probs", batcher)  # releases its graphs after
    assert graphs.captured == LAYERS and graphs.replayed == LAYERS * 3, (graphs.captured, graphs.replayed)
    assert not graphs.graphs, "forward_rows did not release its graphs"
    graph_loss, graph_grads = _update(role, exp, mask, batcher)
    assert graphs.captured == 2 * LAYERS and graphs.replayed == 2 * LAYERS * 3
    del graph_grads[:]  # keep the first update's loss; the second's gradients are compared below
    role.release_graphs()
    gc.collect()
    # a second update from fresh graphs: the same figures, and the graphs' memory all back on release (the
    # first release may leave cuBLAS's workspaces of the capture streams, kept for later captures)
    before = torch.cuda.memory_allocated()
    second_loss, graph_grads = _update(role, exp, mask, batcher)
    before += sum(g.numel() * g.element_size() for g in graph_grads)  # the clones _update returns
    held = torch.cuda.memory_allocated() - before
    role.release_graphs()
    gc.collect()
    left = torch.cuda.memory_allocated() - before
    assert second_loss == graph_loss

    logp_diff = float((graph_logp - eager_logp)[mask.bool()].abs().max())
    assert logp_diff <= 1e-6, logp_diff
    assert float(eager_logp[mask.bool()].abs().max()) > 0.1  # the comparison is not of zeros

    noise = abs(again_loss - eager_loss)
    assert abs(graph_loss - eager_loss) <= 4 * noise + 1e-3 * abs(eager_loss), (graph_loss, eager_loss, noise)
    worst = 0.0
    for e, a, g in zip(eager_grads, again_grads, graph_grads):
        scale = float(e.abs().max())
        eager_noise = float((a - e).abs().max())
        diff = float((g - e).abs().max())
        assert diff <= 4 * eager_noise + 1e-3 * scale, (diff, eager_noise, scale, tuple(e.shape))
        worst = max(worst, diff / max(scale, 1e-30))
    assert held > 0 and left <= 0, (held, left)
    print(
        f"log-prob diff {logp_diff:.3g}; largest gradient diff / scale {worst:.3g}; "
        f"graphs held {held / 1e6:.1f} MB"
    )
