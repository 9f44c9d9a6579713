"""trainer.share_prompts (engine/roles/shared_prompts.py) around the layout, whose forward and backward
tests/engine/test_dynamic_batch.py holds against packed whole rows: a training job (sharing by default)
against the same job without it, the FLOP count against hand-computed values, the grouping, where the default
shares, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from config_compose import composed
from trainer_jobs import CALCULATOR_TASK, read_metrics, run_job
from trainer_parity import skewed_experience

from engine.config import ConfigError
from engine.models.builder import resolve_shape
from engine.roles import shared_prompts
from engine.step.perf import shared_prompt_train_flops, train_flops
from engine.validate.built import built_model
from engine.validate.run import layer_graphs_on, prompts_shared, validate_share_prompts

PPO = ["algorithm=ppo", "trainer.total_steps=1"]


@pytest.mark.parametrize("job", ["ppo", "multi_turn"])
def test_a_job_with_shared_prompts_trains_as_one_without(tmp_path, job):
    """PPO (actor, critic, GAE) on the default task, and GRPO on calculator episodes (tool turns inside the
    response, masked out of the loss), 4 prompts x 4 samples, one step: every loss, gradient norm and statistic
    of the update equal to the job without sharing within float32 summation order."""
    overrides = PPO if job == "ppo" else [*CALCULATOR_TASK, "trainer.total_steps=1"]
    plain, shared = (str(tmp_path / name) for name in ("plain", "shared"))
    run_job([*overrides, "trainer.share_prompts=false"], plain)
    run_job(overrides, shared)  # the default: on (`prompts_shared`)
    (a,), (b,) = read_metrics(plain), read_metrics(shared)
    assert b["perf/shared_prompt_fraction"] > 0.2, b  # 4 samples share each prompt
    assert b["perf/shared_split_fraction"] == 0.0, b  # the CPU gathers keys (the split is CUDA's)
    assert "perf/shared_prompt_fraction" not in a, a
    compared = [k for k in a if k.split("/")[0] in ("actor", "critic", "returns", "advantages")]
    assert len(compared) > 10 and a["reward/mean"] == b["reward/mean"], compared
    for key in compared:
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_prompt_groups_split_and_unit_tokens():
    exp = skewed_experience(5, 12, 6, vocab=40, pad_id=0, n=3)
    groups = shared_prompts.prompt_groups(exp, list(range(12)))
    assert groups == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert shared_prompts.prompt_groups(exp, [4, 0, 3]) == [[4, 3], [0]]
    lengths = {r: int(exp.prompt_lens[r]) + int(exp.response_mask[r].sum()) for r in range(12)}
    prompt = int(exp.prompt_lens[0])
    unit = shared_prompts.unit_tokens(exp, [0, 1, 2], lengths)
    assert unit == prompt + sum(lengths[r] - prompt for r in (0, 1, 2))
    parts = shared_prompts.split_group(exp, [0, 1, 2], lengths, lengths[0] + lengths[1] - prompt)
    assert parts == [[0, 1], [2]]


def test_shared_flops_hand_computed():
    """The rows' count less, per prompt copy not computed, its tokens' layers and P^2 of attention."""
    shape = resolve_shape(composed().model, 512, 1)
    prompt, response = torch.tensor([3, 3, 5]), torch.tensor([2, 4, 1])
    rows = train_flops(shape, prompt + response, response)
    layers = (
        6
        * shape.num_layers
        * (  # the layers' matmul parameters, per token
            shape.hidden_size * shape.head_dim * (2 * shape.num_attention_heads + 2 * shape.num_query_groups)
            + 3 * shape.hidden_size * shape.ffn_hidden_size
        )
    )
    per_key = 12 * shape.num_layers * shape.num_attention_heads * shape.head_dim
    got = shared_prompt_train_flops(shape, prompt, response, [[0, 1], [2]])
    assert got == pytest.approx(rows - (3 * layers + 9 * per_key), rel=1e-12)
    assert shared_prompt_train_flops(shape, prompt, response, [[0], [1], [2]]) == pytest.approx(
        rows, rel=1e-12
    )


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["trainer.pack_sequences=false"], "packed micro-batches"),
        (["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"], "free shapes"),
        (["trainer.cuda_graphs=true", "model.dtype=bfloat16"], "CUDA graphs"),
        (["model=tiny_moe"], "mixture-of-experts"),
    ],
)
def test_layouts_it_cannot_run_are_refused(overrides, needle):
    cfg = composed("trainer.share_prompts=true", *overrides)
    with pytest.raises(ConfigError, match="trainer.share_prompts=True") as err:
        validate_share_prompts(cfg, built_model(cfg))
    assert needle in str(err.value) and "Fix:" in str(err.value)
    validate_share_prompts(composed(*overrides), built_model(cfg))  # off: nothing to refuse


@pytest.mark.parametrize(
    "overrides,cuda,on",
    [
        ([], False, True),  # the default job: packed, n = 8
        ([], True, True),
        (["model.dtype=bfloat16"], True, True),  # sized by memory: no layers' graphs by default
        (["rollout.n=1"], False, False),  # nothing to share
        (["trainer.pack_sequences=false"], False, False),
        (["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"], False, False),
        (["model=tiny_moe"], False, False),
        (["trainer.share_prompts=false"], False, False),
        (["trainer.share_prompts=true", "rollout.n=1"], False, True),  # as set
        # micro-batches by rows on a GPU in bf16: the layers' graphs are on by default and win
        (["model.dtype=bfloat16", "trainer.micro_batch_size=8"], True, False),
        (["model.dtype=bfloat16", "trainer.micro_batch_size=8"], False, True),  # CPU: no graphs
        (["model.dtype=bfloat16", "trainer.cuda_graphs=true"], True, False),
        (["model.dtype=bfloat16", "trainer.max_tokens_per_micro_batch=4096"], True, True),
    ],
)
def test_shared_by_default_where_it_runs(overrides, cuda, on):
    """trainer.share_prompts left empty: on wherever validation would accept true, with more than one response
    per prompt, unless the layers' CUDA graphs are on; set, as set (validation passes either way)."""
    cfg = composed(*overrides)
    if cuda:
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, device="cuda"))
    validate_share_prompts(cfg, built_model(cfg))
    assert prompts_shared(cfg, built_model(cfg)) is on


def test_no_layer_graphs_by_default_with_shared_prompts():
    cfg = composed("model.dtype=bfloat16", "trainer.micro_batch_size=8")
    on_cuda = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, device="cuda"))
    assert layer_graphs_on(on_cuda, built_model(on_cuda))
    shared = dataclasses.replace(on_cuda, trainer=dataclasses.replace(on_cuda.trainer, share_prompts=True))
    assert not layer_graphs_on(shared, built_model(shared))


def test_rows_without_a_shared_prompt_keep_the_whole_rows_layout():
    from engine.roles.dynamic_batch import MicroBatcher

    exp = skewed_experience(6, 8, 6, vocab=40, pad_id=0, n=1)  # every prompt its own
    cpu = torch.device("cpu")
    shared = MicroBatcher(4, 64, 1, cpu, pack=True, share_prompts=True)(exp, torch.arange(8))
    whole = MicroBatcher(4, 64, 1, cpu, pack=True)(exp, torch.arange(8))
    assert [mb["rows"].tolist() for mb in shared] == [mb["rows"].tolist() for mb in whole]
    assert all("prompt_starts" not in mb for mb in shared)


@pytest.mark.parametrize("groups_kv", [4, 2])
def test_segments_of_one_shape_in_one_call_equal_each_segment_alone(groups_kv):
    """The attention's CPU path (engine/models/packed_attention.py `segment_attention`) batches the segments of
    one (queries, keys) shape: prompts (keys = queries, causal) and responses after them (more keys than
    queries, the mask aligned to the keys' end), shapes repeated out of order; output and gradients against each
    segment alone with its mask written out and the key/value groups repeated per head (float32)."""
    from engine.models.packed_attention import segment_attention

    q_lens, k_lens = [4, 3, 3, 2, 4, 3, 1], [4, 7, 7, 2, 4, 7, 3]
    torch.manual_seed(0)
    q = torch.randn(sum(q_lens), 4, 8, requires_grad=True)
    k, v = (torch.randn(sum(k_lens), groups_kv, 8, requires_grad=True) for _ in "kv")
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (q_lens, k_lens)
    )
    out = segment_attention(q, k, v, cu_q, cu_k, 0.4, 0.0)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    rows = []
    for qs, ks, vs in zip(q.split(q_lens), k.split(k_lens), v.split(k_lens)):
        ks, vs = (x.repeat_interleave(4 // groups_kv, dim=1) for x in (ks, vs))
        nq, nk = len(qs), len(ks)
        allowed = torch.arange(nk)[None] <= torch.arange(nq)[:, None] + (nk - nq)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * 0.4
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        rows.append(torch.einsum("hqk,khd->qhd", weights, vs))
    want = torch.cat(rows)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    for a, b in zip(got, torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_gathered_prompts_gradient_is_summed_in_float32_and_rounded_once():
    """The shared layout gathers each prompt's keys and values in front of every response of its group
    (`GatherRows`); the backward sums a row's copies in float32: in bfloat16 the exact sum rounded once, where
    autograd's indexing backward (a bfloat16 store per copy) lands further from it."""
    from engine.models.shared_prompt_attention import GatherRows

    torch.manual_seed(0)
    rows, copies = 64, 9
    index = torch.arange(rows).repeat(copies)[torch.randperm(rows * copies)]
    grad = torch.randn(rows * copies, 2, 16).bfloat16()
    x = torch.randn(rows, 2, 16).bfloat16().requires_grad_()
    out = GatherRows.apply(x, index)
    assert torch.equal(out, x[index])
    (got,) = torch.autograd.grad(out, x, grad)
    (plain,) = torch.autograd.grad(x[index], x, grad)
    exact = torch.zeros(rows, 2, 16, dtype=torch.float64).index_add_(0, index, grad.double())
    assert got.dtype == torch.bfloat16 and torch.equal(got, exact.to(torch.bfloat16))
    assert (plain.double() - exact).abs().mean() > 1.5 * (got.double() - exact).abs().mean()
