"""The actor's update through MegatronRole with the one-pass output head (the loss's gradient in the head's
forward; the default for token-local losses) against the same update with ENGINE_ONE_PASS_HEAD=0 (the two-pass
head: the gradient through the head's backward), world size 1, float32 on CPU: PPO with dual clip, truncated
importance weights, a k3 KL loss and an entropy bonus at temperature 0.8, on skewed rows packed with each
group's prompt once (`response_valid`, shared prompt positions) and padded. The loss and every parameter's
gradient agree (relative 1e-5); the one-pass head ran (its calls counted) in one and not the other. The
sharded layouts against a TP=1 model: tests/parallel/model_parity_script.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from trainer_jobs import SHORT, compose_config, distributed
from trainer_parity import skewed_experience

import engine.roles.policy as policy
from algorithms.losses import loss_normalizer
from engine.roles.dynamic_batch import MicroBatcher
from engine.setup import build_components
from engine.step.losses import make_actor_loss


@pytest.mark.parametrize("pack,share", [(True, True), (False, False)])
def test_one_pass_update_equals_the_two_pass_update(tmp_path, monkeypatch, pack, share):
    cfg = compose_config(
        [
            *SHORT,
            "algorithm=ppo",
            "data.max_prompt_len=24",
            "rollout.max_new_tokens=12",
            f"trainer.output_dir={tmp_path}",
        ]
    )
    alg = replace(
        cfg.algorithm, entropy_coef=0.01, kl_loss_coef=0.05, kl_estimator="k3", tis_cap=1.5, clip_ratio_c=2.0
    )
    calls = []
    one_pass = policy.response_token_grads
    monkeypatch.setattr(policy, "response_token_grads", lambda *a, **k: calls.append(1) or one_pass(*a, **k))
    with distributed(cfg) as groups:
        c = build_components(cfg, groups, str(tmp_path))
        exp = skewed_experience(5, 16, 12, c.shape.vocab_size, c.tokenizer.pad_token_id, n=4)
        mask = exp.response_mask
        gen = torch.Generator().manual_seed(1)
        exp.tensors["old_log_probs"] = (
            exp.tensors["rollout_log_probs"] + 0.3 * torch.randn(mask.shape, generator=gen) * mask
        )
        exp.tensors["ref_log_probs"] = (
            exp.tensors["rollout_log_probs"] - 0.2 * torch.rand(mask.shape, generator=gen) * mask
        )
        norm = loss_normalizer(mask, alg.loss_agg_mode, max_len=12)
        batcher = MicroBatcher(4, 40 if pack else 0, 1, groups.device, pack=pack, share_prompts=share)
        keys = ("advantages", "rollout_log_probs", "old_log_probs", "ref_log_probs")
        got = {}
        for switch in ("1", "0"):
            monkeypatch.setenv("ENGINE_ONE_PASS_HEAD", switch)
            calls.clear()
            mbs = batcher(exp, torch.arange(exp.num_rows), keys)
            assert not pack or "response_valid" in mbs[0]
            outs = c.actor.run(
                mbs, make_actor_loss(alg, norm, kl_ref=True), forward_only=False, temperature=0.8
            )
            grads = [p.main_grad.detach().clone() for ch in c.actor.chunks for p in ch.parameters()]
            got[switch] = (sum(float(o["loss"]) for o in outs), grads, len(calls))
    (loss1, grads1, calls1), (loss0, grads0, calls0) = got["1"], got["0"]
    assert calls1 == len(mbs) and calls0 == 0
    assert abs(loss1 - loss0) <= 1e-6 * abs(loss0)
    scale = max(float(g.abs().max()) for g in grads0)
    assert scale > 0
    worst = max(float((a - b).abs().max()) for a, b in zip(grads1, grads0)) / scale
    assert worst <= 1e-5, worst
