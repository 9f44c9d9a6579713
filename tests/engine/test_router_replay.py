"""Routing replay (`algorithm.router_replay`: engine/rollout/routes.py records, engine/roles/router_replay.py
replays), world size 1 in the pytest process: a tiny megatron MoE actor, the native rollout on its weights,
the responses through `experience_from` and `MicroBatcher` into `MegatronRole` forwards, as a step runs them.

Forcing different routing: the rollout's and the trainer's routers differ in expert 0's row only. The
rollout's row 0 is zero and rows 1-4 are (u, -u, v, -v), so two experts always score above 0 and expert 0 is
never among a token's top-2; the trainer's row 0 is large, so recomputed routing picks expert 0 often. With
replay the trainer routes to the rollout's experts and its gate weights (softmax over the chosen experts'
logits) use rows that both sides share: log-probs equal the rollout's. Tolerance: float32, 1e-5 absolute.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig, MoEConfig
from engine.data import PromptRecord
from engine.models.builder import build_gpt_chunks, resolve_shape
from engine.roles.dynamic_batch import MicroBatcher
from engine.roles.policy import MegatronRole
from engine.roles.router_replay import RouterReplay
from engine.rollout.base import SamplingParams
from engine.rollout.native import NativeRollout
from engine.step.batch import ROUTES, Responses, experience_from
from engine.step.losses import log_prob_fn
from engine.step.update import forward_rows
from parallel.rollout_weights import RolloutWeights

CPU = torch.device("cpu")
VOCAB, HIDDEN, EXPERTS, TOP_K = 40, 32, 6, 2
PROMPTS = ([3, 9, 4], [7, 1, 5, 2, 8, 6, 11], [12, 2, 30, 5, 17])
TOL = 1e-5


def moe_actor(groups):
    m = ModelConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        max_position_embeddings=64,
        moe=MoEConfig(num_experts=EXPERTS, top_k=TOP_K, ffn_hidden_size=16),
    )
    shape = resolve_shape(m, VOCAB, 1)
    torch.manual_seed(0)
    (model,) = build_gpt_chunks(shape, groups, init_std=0.2, recompute=False)
    return model, shape


def routers(params: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in params if name.endswith("mlp.router.weight")]


def rollout_and_trainer_weights(model, differ: bool) -> dict[str, torch.Tensor]:
    """Set the model's routers (the trainer's) and return the rollout's weights (module docstring)."""
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(5)
    rollout = {name: p.detach().clone() for name, p in params.items()}
    for name in routers(params):
        u, v, w = (torch.randn(HIDDEN, generator=g) for _ in range(3))
        rows = torch.stack([torch.zeros(HIDDEN), u, -u, v, -v, w])
        rollout[name] = rows.clone()
        if differ:
            rows[0] = 3 * torch.randn(HIDDEN, generator=g)
        with torch.no_grad():
            params[name].copy_(rows)
    return rollout


def rollout_experience(shape, rollout_params: dict[str, torch.Tensor]):
    """(native rollout output, the Experience built from its responses)."""
    engine = NativeRollout(shape, CPU, pad_id=0)
    engine.set_weights(RolloutWeights(rollout_params, 1, 0, None, None, 0, 1))
    sampling = SamplingParams(n=2, max_new_tokens=6, stop_token_ids=(1,), seed=0, routed_experts=True)
    out = engine.generate([list(p) for p in PROMPTS], sampling)
    records = [PromptRecord(prompt_ids=list(p), data_source="t", ground_truth="") for p in PROMPTS]
    rows = out.response_ids.shape[0]
    resp = Responses(
        records=records,
        n=2,
        response_ids=out.response_ids,
        response_mask=out.response_mask,
        log_probs=out.log_probs,
        finished=torch.zeros(rows),
        scores=torch.zeros(rows),
        routed_experts=out.routed_experts,
    )
    return out, experience_from(resp, 0, pad_id=0, seq_multiple=1, rollout_log_probs=True)


BATCHERS = {
    "padded": lambda: MicroBatcher(2, 0, 1, CPU),
    "packed": lambda: MicroBatcher(0, 40, 1, CPU, pack=True),
}


@pytest.mark.parametrize("layout", list(BATCHERS))
def test_replay_makes_training_log_probs_equal_the_rollouts(groups, layout):
    """Routers that differ: recomputed routing moves the training log-probs away from the rollout's, the
    replayed one gives the rollout's within 1e-5 (prompt positions from the prefill, response tokens from
    the decode steps), and the agreement metric sees the differing choices; equal routers: agreement 1."""
    model, shape = moe_actor(groups)
    rollout_params = rollout_and_trainer_weights(model, differ=True)
    out, exp = rollout_experience(shape, rollout_params)
    routes = exp.tensors[ROUTES]
    assert routes.shape[:2] == exp.tokens.shape and routes.shape[2:] == (shape.num_layers, TOP_K)
    assert not (routes == 0).any(), "the rollout's routers never pick expert 0"
    for r in range(exp.num_rows):  # recorded exactly on [prompt, response] less the last response token
        length = int(exp.prompt_lens[r] + exp.response_mask[r].sum())
        assert (routes[r, : length - 1] >= 0).all() and (routes[r, length - 1 :] == -1).all(), r

    actor = MegatronRole([model], groups, shape, None)
    actor.router_replay = RouterReplay(actor.models, actor.config, 0, groups.world, CPU)
    mask = exp.response_mask.bool()

    def training_log_probs(e):
        return forward_rows(actor, e, log_prob_fn, "log_probs", BATCHERS[layout]())[mask]

    replayed = training_log_probs(exp)
    agreement = actor.router_replay.metrics()["router_replay_agreement"]
    no_routes = experience_from_without_routes(exp)
    recomputed = training_log_probs(no_routes)
    assert actor.router_replay.metrics() == {}  # nothing replayed: no agreement to report

    want = out.log_probs[mask]
    assert (recomputed - want).abs().max() > 1e-2  # the routing differs, and so do the log-probs
    torch.testing.assert_close(replayed, want, atol=TOL, rtol=0)
    assert 0.0 < agreement < 1.0

    rollout_params = rollout_and_trainer_weights(model, differ=False)
    out, exp = rollout_experience(shape, rollout_params)
    torch.testing.assert_close(
        training_log_probs(exp), out.log_probs[exp.response_mask.bool()], atol=TOL, rtol=0
    )
    assert actor.router_replay.metrics()["router_replay_agreement"] == 1.0


def experience_from_without_routes(exp):
    from dataclasses import replace

    return replace(exp, tensors={k: v for k, v in exp.tensors.items() if k != ROUTES})


def test_gradients_reach_the_router_through_the_replayed_experts(groups):
    """The replayed top-k keeps the gate weights differentiable: the router's rows of the replayed experts
    get gradient, the row of an expert the rollout never chose (0) gets none from the response log-probs
    (no aux loss here), which recomputed routing, choosing it, does give."""
    grads = {}
    for name in ("replayed", "recomputed"):
        model, shape = moe_actor(groups)
        rollout_params = rollout_and_trainer_weights(model, differ=True)
        _, exp = rollout_experience(shape, rollout_params)
        if name == "recomputed":
            exp = experience_from_without_routes(exp)
        replay = RouterReplay([model], model.config, 0, groups.world, CPU)
        (mb,) = MicroBatcher(exp.num_rows, 0, 1, CPU)(exp, torch.arange(exp.num_rows))
        replay.install(model, mb)
        logits = model(mb["tokens"], mb["positions"], None)  # (b, s, vocab)
        logp_bs = logits[:, :-1].float().log_softmax(-1).gather(-1, mb["tokens"][:, 1:, None])[..., 0]
        (logp_bs.gather(1, mb["response_index"]) * mb["response_mask"]).sum().backward()  # the actor's loss
        grads[name] = [p.grad.clone() for n, p in model.named_parameters() if n.endswith("router.weight")]
    for replayed, recomputed in zip(grads["replayed"], grads["recomputed"]):
        assert torch.equal(replayed[0], torch.zeros(HIDDEN))
        assert (replayed[1:].norm(dim=-1) > 0).all()
        assert recomputed[0].norm() > 0


def test_default_job_with_router_replay_runs(tmp_path):
    """The default job on model=tiny_moe with algorithm.router_replay=true: every step logs the agreement,
    1.0 here (colocated and on-policy: the rollout routes with the weights the actor trains)."""
    import json
    import subprocess
    import sys

    from distributed import subprocess_env

    out = tmp_path / "run"
    args = [
        "model=tiny_moe",
        "algorithm.router_replay=true",
        "trainer.total_steps=2",
        f"trainer.output_dir={out}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "engine.train", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["actor/router_replay_agreement"] for r in rows] == [1.0, 1.0]
