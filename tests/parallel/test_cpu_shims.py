"""Each megatron-core CPU shim (parallel/cpu.py) exercised against the real megatron code it works around.

World size 1 (one process, gloo). If a megatron upgrade moves a target, the matching test fails here
instead of deep inside a training step.
"""

from __future__ import annotations

import pytest
import torch

from parallel.dims import ParallelDims


@pytest.fixture(scope="module")
def groups():
    from parallel.state import destroy_distributed, init_distributed

    g = init_distributed(ParallelDims(world_size=1), "cpu", seed=7)
    yield g
    destroy_distributed()


def test_shim1_current_device_feeds_megatron_allocations(groups):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    assert torch.cuda.current_device() == torch.device("cpu")
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=False)
    assert rope(5).device.type == "cpu"


def test_shim2_rng_tracker_forks_cpu_generator_states(groups):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert "model-parallel-rng" in tracker.get_states()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b), "the forked state must advance between forks"
    assert torch.equal(torch.get_rng_state(), before), "the default generator must be restored"


def test_shim3_synchronize_is_a_noop(groups):
    torch.cuda.synchronize()


def test_shim4_literal_cuda_tensors_land_on_cpu(groups):
    x = torch.zeros(2, device="cuda")
    assert x.device.type == "cpu"
    assert torch.ones(1).cuda().device.type == "cpu"


def test_shim5_type_reports_cuda_names_for_megatron_asserts(groups):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    assert p.grad.type() == "torch.cuda.FloatTensor"
    assert p.type(torch.float64).dtype == torch.float64  # conversions still work
    norm = get_grad_norm_fp32([p.grad])
    assert norm == pytest.approx(4.0)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=norm)  # asserts the cuda type name
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5)


def test_shim7_moe_side_streams_are_the_one_cpu_stream(groups):
    """megatron's all-to-all token dispatcher makes a class-wide CUDA side stream at construction and copies
    its split sizes on it; on CPU every stream is one object, so its "side stream" branch is never taken."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    assert torch.cuda.Stream() is torch.cuda.current_stream()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.current_stream().record_event().synchronize()
    assert hasattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream")  # the target the shim serves


def test_shim8_dispatcher_split_sizes_become_host_arrays(groups):
    """all_to_all_single takes split sizes as a list/array, not a tensor: the dispatcher's host copy of them
    must give numpy on CPU as it does from CUDA."""
    from megatron.core.transformer.moe import token_dispatcher

    sizes = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert sizes.tolist() == [3, 1] and not torch.is_tensor(sizes)
    kept = torch.tensor([2])
    assert token_dispatcher.maybe_move_tensor_to_cpu(kept) is kept


def test_megatron_optimizer_and_schedule_run_on_cpu(groups):
    """The pieces that combine shims 1, 2, 4 and 5: build, DDP, optimizer step, forward/backward schedule."""
    from engine.config import ModelConfig, OptimConfig
    from engine.models.builder import build_gpt_chunks, resolve_shape
    from engine.roles.policy import MegatronRole

    shape = resolve_shape(ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64), 40, 1)
    chunks = build_gpt_chunks(shape, groups, init_std=0.02, recompute=False)
    role = MegatronRole(chunks, groups, shape, OptimConfig(clip_grad=1.0), head="logits")
    tokens = torch.randint(0, 40, (2, 6))
    mb = {"tokens": tokens, "positions": torch.arange(6).expand(2, 6)}

    def loss_fn(logits, mb):
        loss = logits.float().logsumexp(-1).mean()
        return loss, {"loss": loss.detach()}

    before = [p.detach().clone() for p in role.chunks[0].parameters()]
    role.run([mb], loss_fn, forward_only=False)
    stats = role.optimizer_step()
    assert stats.grad_norm > 0 and not stats.skipped
    assert any(not torch.equal(a, b) for a, b in zip(before, role.chunks[0].parameters()))
