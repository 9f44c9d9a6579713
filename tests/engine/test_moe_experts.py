"""The native rollout's sync-free routed experts (engine/models/moe.py `grouped_routed_experts`, run through
engine/rollout/moe_experts.py) against the loop over the experts, on CPU (no processes).

Tolerance: float32 outputs within 1e-6 of the loop (the same GEMMs on the same rows, summed in the same
order: equal in practice); bfloat16 under torch.compile equal to eager bfloat16 within one bf16 ulp of the
output scale. The absence of host syncs is checked by compiling with `fullgraph=True`: `nonzero`, `.item()`
or a branch on a tensor's value is a graph break there, which fullgraph turns into an error. The engine in
bfloat16 against transformers' float32 greedy decode: tests/engine/moe_greedy_reference.py's rule (routes equal
up to float32 router ties, log-probs within bfloat16's noise before them).
"""

from __future__ import annotations

import dataclasses

import hf_tiny
import pytest
import torch
from moe_greedy_reference import ROUTE_TIE, check_bf16_greedy, check_bf16_greedy_rows, router_probs
from test_rollout_native import random_prompts, rollout_weights_from_hf

from engine.models import moe
from engine.models.builder import MoEShape
from engine.rollout.base import SamplingParams
from engine.rollout.moe_experts import moe_layer
from engine.rollout.native import NativeRollout
from parallel.rollout_weights import RolloutWeights

E, H, F = 5, 16, 8


def _case(top_k: int, score: str, norm: bool, dtype=torch.float32, tokens: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = MoEShape(num_experts=E, top_k=top_k, ffn_hidden_size=F, score_function=score, norm_topk_prob=norm)
    x = torch.randn(tokens, H, generator=g)
    x[:, 0] = x[:, 0].abs() + 1
    router = torch.randn(E, H, generator=g)
    router[3] = 0
    router[3, 0] = -100  # expert 3: the lowest score for every token
    x = x.to(dtype)
    fc1 = torch.randn(E, 2 * F, H, generator=g).to(dtype)
    fc2 = torch.randn(E, H, F, generator=g).to(dtype)
    return shape, x, router.to(dtype), fc1, fc2


@pytest.mark.parametrize("top_k", (1, 2, 3))
@pytest.mark.parametrize("score,norm", (("softmax", True), ("softmax", False), ("sigmoid", True)))
def test_grouped_experts_equal_the_expert_loop(top_k, score, norm):
    shape, x, router, fc1, fc2 = _case(top_k, score, norm)
    want, want_index = moe.routed_experts(x, router, list(fc1), list(fc2), shape)
    assert not (want_index == 3).any() and top_k < E - 1  # an expert with no token
    got, index = moe.grouped_routed_experts(x, router, fc1, fc2, shape)
    assert torch.equal(index, want_index)  # the router's ranking, for routing replay
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_sort_by_expert_groups_assignments_and_offsets_skip_empty_experts():
    index_tk = torch.tensor([[4, 0], [0, 2], [4, 2], [2, 0]])
    order, ends = moe.sort_by_expert(index_tk, E)
    flat = index_tk.reshape(-1)
    assert order.tolist() == [1, 2, 7, 3, 5, 6, 0, 4]  # stable: token order within an expert
    assert flat[order].tolist() == sorted(flat.tolist())
    assert ends.dtype == torch.int32 and ends.tolist() == [3, 3, 6, 6, 8]  # experts 1 and 3: empty


def test_grouped_experts_compile_without_host_syncs():
    shape, x, router, fc1, fc2 = _case(2, "softmax", True, dtype=torch.bfloat16)
    eager = moe.grouped_routed_experts(x, router, fc1, fc2, shape)
    torch._dynamo.reset()
    graph = torch.compile(moe.grouped_routed_experts, fullgraph=True, backend="eager")
    out, index = graph(x, router, fc1, fc2, shape)
    assert torch.equal(index, eager[1])
    torch.testing.assert_close(out, eager[0], atol=eager[0].abs().max().item() / 128, rtol=0)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="data-dependent|graph break|nonzero"):  # the check catches a sync
        torch.compile(moe.routed_experts, fullgraph=True, backend="eager")(
            x, router, list(fc1), list(fc2), shape
        )
    torch._dynamo.reset()


def test_rollout_stacks_consecutive_experts_as_views_and_copies_others():
    shape, x, router, fc1, fc2 = _case(2, "softmax", True)
    pre = "decoder.layers.0.mlp."
    params = {pre + "router.weight": router}
    for e in range(E):  # views of one (E, ...) buffer per weight
        params[f"{pre}experts.local_experts.{e}.linear_fc1.weight"] = fc1[e]
        params[f"{pre}experts.local_experts.{e}.linear_fc2.weight"] = fc2[e]
    layer = moe_layer(params, pre, shape, lambda p, n: p[n])
    assert layer.grouped and layer.fc1_efh is None  # built at the first forward
    out, _ = layer.routed(x, shape)
    assert layer.fc1_efh.data_ptr() == fc1.data_ptr() and layer.fc2_ehf.data_ptr() == fc2.data_ptr()
    torch.testing.assert_close(out, moe.routed_experts(x, router, list(fc1), list(fc2), shape)[0])
    layer.free_stacked()
    layer.expert_fc1 = [w.clone() for w in fc1]  # one tensor per expert: stacked as a copy
    layer.routed(x, shape)
    assert layer.fc1_efh.data_ptr() != fc1.data_ptr() and torch.equal(layer.fc1_efh, fc1)


@pytest.mark.parametrize("family", hf_tiny.MOE_FAMILIES)
def test_bf16_greedy_follows_transformers_float32_up_to_router_ties(tmp_path, family):
    """The native engine in bfloat16 on CPU (grouped experts, the path CUDA graphs capture) decoding greedily:
    each row routes as transformers' float32 model does until float32's router nearly ties, its log-probs
    within bfloat16's noise before that, its tokens float32's unless a tie parts them; and the rule catches a
    route or a log-prob that is wrong."""
    from transformers import AutoModelForCausalLM

    path = hf_tiny.save_tiny(family, str(tmp_path / family), seed=0)
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    shape, weights = rollout_weights_from_hf(path)
    shape = dataclasses.replace(shape, dtype=torch.bfloat16)
    params = {k: v.to(torch.bfloat16) for k, v in weights.params.items()}
    engine = NativeRollout(shape, torch.device("cpu"), pad_id=0, max_num_seqs=4)
    engine.set_weights(RolloutWeights(params, 1, 0, None, None, 0, 1))
    prompts, new = random_prompts(shape.vocab_size), 12
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new, routed_experts=True))
    # 4 experts, top 2, random routers: ties come often (gaps of 2e-5..7e-3 here, some in the prompts); at
    # least half of the tokens are still compared
    refs = check_bf16_greedy_rows(hf32, hf16, prompts, out, new)
    # the rule's teeth: row 0 (no flip, every token compared) routed to float32's least likely experts at
    # layer 0 at its first position that is no tie ...
    assert check_bf16_greedy(hf32, hf16, prompts[0], refs[0], out, 0) == new
    k = shape.moe.top_k
    ranked = router_probs(hf32, torch.tensor([prompts[0] + refs[0]]))[0].sort(-1, descending=True)
    pos = next(
        p
        for p in range(len(prompts[0]) + new - 1)
        if ranked.values[p, k - 1] - ranked.values[p, k] >= ROUTE_TIE
    )
    bad = dataclasses.replace(out, routed_experts=out.routed_experts.clone())
    bad.routed_experts[0, pos, 0] = ranked.indices[pos, -k:].to(bad.routed_experts.dtype)
    with pytest.raises(AssertionError, match="tie"):
        check_bf16_greedy(hf32, hf16, prompts[0], refs[0], bad, 0)
    # ... and a log-prob 0.2 nat off before any flip
    bad = dataclasses.replace(out, log_probs=out.log_probs.clone())
    bad.log_probs[0, 0] -= 0.2
    with pytest.raises(AssertionError):
        check_bf16_greedy(hf32, hf16, prompts[0], refs[0], bad, 0)
