"""A bfloat16 MoE engine's greedy tokens and log-probs held to transformers' float32 model, routing included
(tests/engine/test_moe_experts.py on CPU, tests/engine/test_moe_gpu.py on CUDA).

In bfloat16 a token's top-k experts flip wherever float32's k-th and (k+1)-th router probabilities nearly tie,
and from that position on the two models compute different functions: logits after a flip are not comparable,
and greedy tokens may part. transformers' own bfloat16 model is no oracle for that: it rounds the router's input
in another order than megatron's (which the native rollout follows, engine/rollout/moe_experts.py) and flips
at other ties, or none. So each row is checked in two parts:
- every position whose inputs are float32's (the prompt, then the response while its tokens agree) routes as
  float32 does, or, at the first position that does not, float32's router nearly ties there (`ROUTE_TIE`);
- before that flip, the log-probs are float32's within bfloat16's noise (transformers' bfloat16 model's
  distance to float32 on the same tokens, or 5e-2), and where the tokens part before any flip, float32's top
  two logits there lie within that noise.
"""

from __future__ import annotations

import torch
from test_rollout_native import hf_greedy

ROUTE_TIE = 0.02
"""The largest float32 router-probability gap between a token's k-th and (k+1)-th experts at which a bfloat16
engine may pick the other one (bf16 rounding of the router's input moves probabilities by ~1e-3..1e-2)."""


def router_probs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the float32 router probabilities (positions, experts) of transformers `model` on `ids`
    (1, t)."""
    logits = []

    def keep(module, args, out):  # transformers 5.x routers return (logits, scores, indices); older a tensor
        logits.append((out[0] if isinstance(out, tuple) else out).float())

    hooks = [layer.mlp.gate.register_forward_hook(keep) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [x.reshape(ids.shape[1], -1).softmax(-1) for x in logits]


def first_route_flip(
    probs: list[torch.Tensor], routes: torch.Tensor, positions: int
) -> tuple[int, float] | None:
    """(position, float32's k-th minus (k+1)-th probability there) of the first of `positions` where the
    engine's `routes` (positions, layers, k) pick other experts than float32's `probs` in any layer; None if
    none."""
    k = routes.shape[-1]
    for pos in range(positions):
        for layer, p in enumerate(probs):
            top = p[pos].topk(k + 1)
            if set(top.indices[:k].tolist()) != set(routes[pos, layer].tolist()):
                return pos, (top.values[k - 1] - top.values[k]).item()
    return None


def check_bf16_greedy(hf32, hf16, prompt: list[int], ref_tokens: list[int], out, row: int) -> int:
    """Hold `out` (a bf16 generate's output with `routed_experts`) at `row` to transformers' float32 greedy
    `ref_tokens` from `prompt` (module docstring); `hf16` gives bf16's noise. Returns how many response tokens'
    log-probs were compared (those before any route flip and token parting)."""
    new, plen = len(ref_tokens), len(prompt)
    assert (out.routed_experts[row, : plen + new - 1] >= 0).all(), row  # every fed position routed
    ours = out.response_ids[row].tolist()[:new]
    same = next((j for j in range(new) if ours[j] != ref_tokens[j]), new)
    ids = torch.tensor([prompt + ref_tokens])
    # positions fed float32's inputs: the prompt and the agreed tokens (response token j sits at plen + j)
    flip = first_route_flip(
        router_probs(hf32, ids), out.routed_experts[row].long(), plen + min(same, new - 1)
    )
    if flip is not None:
        assert flip[1] < ROUTE_TIE, (row, "routes part from float32's where its router does not tie", flip)
    # token j comes from the logits at position plen - 1 + j, which a flip at position f reaches from
    # j >= f - plen + 1 on
    clean = same if flip is None else min(same, max(0, flip[0] - plen + 1))
    with torch.no_grad():
        logits = hf32(ids).logits[0, plen - 1 : -1].float()
        lo = hf16(ids).logits[0, plen - 1 : -1].float()
    if same < new and flip is None:  # the tokens part with every route float32's: only where its top two tie
        top2 = logits[same].topk(2).values
        margin, noise = (top2[0] - top2[1]).item(), (lo[same] - logits[same]).abs().max().item()
        assert margin < max(0.05, 2 * noise), (row, same, margin, noise)
    index = torch.tensor(ref_tokens)[:, None]
    logp = logits.log_softmax(-1).gather(-1, index).squeeze(-1)[:clean]
    floor = lo.log_softmax(-1).gather(-1, index).squeeze(-1)[:clean] - logp
    atol = max(5e-2, 2 * floor.abs().max().item()) if clean else 5e-2
    torch.testing.assert_close(out.log_probs[row, :clean].float().cpu(), logp, atol=atol, rtol=0)
    return clean


def check_bf16_greedy_rows(hf32, hf16, prompts: list[list[int]], out, new: int) -> list[list[int]]:
    """`check_bf16_greedy` on every row of `out` against float32's greedy tokens, at least half of all tokens'
    log-probs compared (so the rule cannot pass by excusing every row at a tie); float32's tokens per row."""
    refs = [hf_greedy(hf32, prompt, new)[0] for prompt in prompts]
    compared = sum(
        check_bf16_greedy(hf32, hf16, p, ref, out, i) for i, (p, ref) in enumerate(zip(prompts, refs))
    )
    assert compared >= len(prompts) * new // 2, compared
    return refs
