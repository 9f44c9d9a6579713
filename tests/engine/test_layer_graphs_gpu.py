"""The layers from CUDA graphs (trainer.cuda_graphs, engine/models/layer_graphs.py) against the same role run
eagerly, on CUDA (marked `gpu`, skipped on CPU; world size 1 in the pytest process, NCCL).

A 3-layer bf16 model (hidden 256, 8 query heads in 2 groups, QKV bias) runs an actor update and a forward-only
log-prob pass over packed micro-batches of 4 equal rows (one shape, captured on its second micro-batch and
replayed from the third) and a last micro-batch of another shape (eager); and over long-tailed rows padded to
one layout per call (one signature). Each micro-batch holds other tokens,
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


def _experience(rows: int, seed: int, long_tailed: bool = False):
    """`rows` rows of PROMPT + RESPONSE tokens, all as long (the last one shorter: its own micro-batch), or
    `long_tailed`: responses of 1 to RESPONSE tokens, a few at the limit."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, VOCAB, (rows, PROMPT), generator=gen)
    response_ids = torch.randint(1, VOCAB, (rows, RESPONSE), generator=gen)
    lengths = torch.full((rows,), RESPONSE)
    lengths[-1] = RESPONSE // 2
    if long_tailed:
        lengths = torch.randint(1, RESPONSE // 2, (rows,), generator=gen)
        lengths[::5] = RESPONSE
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

    eager = (eager_logp, eager_loss, eager_grads)
    worst, logp_diff = _compare(mask, eager, (again_loss, again_grads), (graph_logp, graph_loss, graph_grads))
    assert held > 0 and left <= 0, (held, left)
    print(
        f"log-prob diff {logp_diff:.3g}; largest gradient diff / scale {worst:.3g}; "
        f"graphs held {held / 1e6:.1f} MB"
    )


def _compare(mask, eager, again, graph) -> tuple[float, float]:
    """Graphs against eager (the module docstring's tolerances), each (log-probs, loss, gradients); `again`:
    a second eager update's (loss, gradients). Returns (largest gradient diff / scale, log-prob diff)."""
    (eager_logp, eager_loss, eager_grads), (graph_logp, graph_loss, graph_grads) = eager, graph
    again_loss, again_grads = again
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
    return worst, logp_diff


def test_long_tailed_micro_batches_replay_under_one_layout(cuda_groups, monkeypatch):
    """Rows of 25 to 64 tokens grouped by width: as packed alone every micro-batch is a shape of its own;
    padded to one layout per call (`shapes="graphs"`, as trainer_batcher with trainer.cuda_graphs; the last,
    small micro-batch keeps its own shape) the call is one signature: captured on its second micro-batch,
    replayed from the third, equal to eager on the same layout, and close to eager on the unpadded layout
    (bf16: the layouts differ in GEMM shapes, so in rounding)."""
    from engine.models import packed_attention

    monkeypatch.setattr(packed_attention, "RECURRING", packed_attention.RecurringShapes())
    role = _role(cuda_groups)
    exp, mask = _experience(40, seed=2, long_tailed=True)
    one = MicroBatcher(4, 0, seq_multiple=1, device=cuda_groups.device, pack=True, shapes="graphs")
    free = MicroBatcher(4, 0, seq_multiple=1, device=cuda_groups.device, pack=True)
    layouts = [mb["tokens"].shape[1] for mb in free(exp, torch.arange(exp.num_rows))]
    assert len(set(layouts)) > 2 and len(layouts) >= 5, layouts  # more shapes than MAX_SHAPES
    padded = [mb["tokens"].shape[1] for mb in one(exp, torch.arange(exp.num_rows))]
    calls = padded.count(max(padded))  # the rest (the last, small one) keep their own shape: eager
    assert calls >= 4 and len(set(padded)) == len(padded) - calls + 1, padded

    free_logp = forward_rows(role, exp, log_prob_fn, "log_probs", free)
    eager_logp = forward_rows(role, exp, log_prob_fn, "log_probs", one)
    eager_loss, eager_grads = _update(role, exp, mask, one)
    again_loss, again_grads = _update(role, exp, mask, one)

    role.use_cuda_graphs()
    graphs = role.layer_graphs
    graph_logp = forward_rows(role, exp, log_prob_fn, "log_probs", one)
    assert graphs.captured == LAYERS and graphs.replayed == LAYERS * (calls - 2), (graphs.captured, calls)
    graph_loss, graph_grads = _update(role, exp, mask, one)
    assert graphs.replayed == 2 * LAYERS * (calls - 2)
    role.release_graphs()

    eager = (eager_logp, eager_loss, eager_grads)
    worst, logp_diff = _compare(mask, eager, (again_loss, again_grads), (graph_logp, graph_loss, graph_grads))
    layout_diff = float((free_logp - eager_logp)[mask.bool()].abs().max())
    assert layout_diff <= 0.05, layout_diff  # bf16 rounding of log-probs near -6 (an ulp there: 0.03)
    print(
        f"log-prob diff {logp_diff:.3g} (vs unpadded layout {layout_diff:.3g}); gradient diff / scale {worst:.3g}"
    )
