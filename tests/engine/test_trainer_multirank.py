"""The trainer at world size 4, in ONE torchrun launch (tests/engine/trainer_run_script.py): PPO with its
critic at TP=2 x PP=2 (3 steps, validation on the last; packed micro-batches, the default), DAPO with dynamic
sampling across 2 DP replicas and token-budget micro-batches, ReMax at PP=2 with 2 mini-batches and
token-budget micro-batches, GRPO scored by a reward model (reward.model_path) at TP=2 x PP=2 (padded
micro-batches) equal to transformers' scores, the forward-only paths (old/ref log-probs, values, reward
scores) with a short last micro-batch at PP=2 and PP=2 x VPP=2 equal to PP=1, then the loss/gradient parity of
token-budget vs fixed micro-batches at TP=2 x PP=2 (stages exchange shapes), packed vs padded micro-batches
(log-probs, entropy, values, scores, actor and critic gradients) at TP=2 x PP=2 with SP off and on and at
PP=2 x VPP=2, then the advantages of the same 16 rows at DP=1 and DP=2 (whitening summed over DP with gloo), then
one step at DP=4 with the groups re-dealt over the replicas by tokens (trainer.balance_batch) and without, then
two steps of model=tiny_moe at TP=2 (SP) x DP=2 and at PP=2 x DP=2 (rollout.tp=1) with parallel.ep=1
and 2 (same init, rollout and first update; at step 2 the TP ranks' replicated weights are equal and
rollout_kl is small; the EP=2 jobs export the actor to Hugging Face format, checked against the trained
experts and loaded by transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from distributed import run_torchrun

SCRIPT = str(Path(__file__).with_name("trainer_run_script.py"))


def _reported(out: str, name: str) -> dict:
    """The JSON object a rank printed after `name`: decoded up to its own end, since torchrun's rank prefix
    ("[default0]:") of the next line can land on the same line when ranks print at once."""
    return json.JSONDecoder().raw_decode(out.split(name, 1)[1].lstrip())[0]


def test_world4_ppo_tp2_pp2_dapo_remax_reward_model_and_dynamic_batch_parity(tmp_path):
    import hf_tiny

    from engine.tasks.embedded import EMBEDDED_VOCAB

    vocab = len(EMBEDDED_VOCAB)
    hf_tiny.save_tiny("qwen2", str(tmp_path / "reward_model"), seed=3, head="sequence", vocab_size=vocab)
    hf_tiny.save_tiny("qwen2", str(tmp_path / "policy"), seed=4, vocab_size=vocab)
    hf_tiny.save_tiny("qwen2", str(tmp_path / "critic"), seed=5, head="token", vocab_size=vocab)
    out = run_torchrun(SCRIPT, 4, [str(tmp_path)])
    for job in ("ppo_tp2_pp2", "dapo_tp2_dp2_budget", "remax_pp2_dp2_budget", "grpo_reward_model_tp2_pp2"):
        assert f"job {job} ok" in out, out[-4000:]
    # float32 at TP=2 x PP=2 against transformers: summation order only
    assert float(out.split("reward_model_max_abs_diff ", 1)[1].split()[0]) <= 1e-4, out[-4000:]
    # a short last micro-batch at PP=2 and PP=2 x VPP=2 gives the PP=1 result on every forward path
    remainder = _reported(out, "pp_remainder ")
    assert remainder.pop("pp2/update_short_last_refused") == 1.0, remainder
    assert len(remainder) == 8 and max(remainder.values()) <= 1e-5, remainder  # float32, summation order
    parity = _reported(out, "parity ")
    # float32: the splits differ only in summation order
    assert parity["loss_diff"] <= 1e-5 * abs(parity["loss_fixed"]), parity
    assert parity["grad_diff"] <= 1e-5 * parity["grad_scale"], parity
    assert parity["tokens_budget"] < 0.7 * parity["tokens_fixed"], parity
    # packed vs padded micro-batches at TP=2 x PP=2, SP off and on (token budget), without a budget (the
    # default: packed grouped up to 4 rows x the batch's width, against 4 padded rows each), and at PP=2 x VPP=2
    # (4 rows each; packed ones padded to one length per call): every head and both updates
    for layout in ("sp_false", "sp_true", "by_width", "vpp2"):
        packing = _reported(out, f"packing_{layout} ")
        for key in ("log_probs", "entropy", "values", "scores"):
            assert packing[key] <= 2e-5, (layout, packing)  # float32, summation order
        for key in ("actor_grad_rel", "actor_loss_rel", "critic_grad_rel", "critic_loss_rel"):
            assert packing[key] <= 1e-5, (layout, packing)
        assert packing["tokens_packed"] < packing["tokens_padded"], (layout, packing)
        if layout == "by_width":  # 16 rows of skewed lengths: more than 4 share a micro-batch
            assert packing["micro_batches_packed"] < packing["micro_batches_padded"] == 4, packing
        if layout != "vpp2":  # SP rounds each packed micro-batch up to a multiple of tp=2: at most one token
            assert packing["tokens_packed"] - packing["tokens_real"] <= 0.05 * packing["tokens_real"], (
                layout,
                packing,
            )
    # each group's prompt once (trainer.share_prompts) vs packed rows at TP=2 x PP=2 with SP, 4 rows a prompt
    shared = _reported(out, "packing_shared ")
    for key in ("log_probs", "entropy", "values", "scores"):
        assert shared[key] <= 2e-5, shared
    for key in ("actor_grad_rel", "actor_loss_rel", "critic_grad_rel", "critic_loss_rel"):
        assert shared[key] <= 1e-5, shared
    assert (
        shared["tokens_real"] < shared["row_tokens"] and shared["tokens_shared"] < shared["tokens_packed"]
    ), shared
    # gae, reinforce_pp (KL in the reward), reinforce_pp_baseline, grpo: float64 moments, float32 advantages
    dp_invariance = _reported(out, "dp_invariance ")
    assert max(dp_invariance.values()) <= 1e-6, dp_invariance
    # groups re-dealt over 4 replicas by tokens: the same update (float32, summation order), less imbalance
    balanced = _reported(out, "balance_batch ")
    assert balanced["max_diff"] <= 1e-5 and balanced["keys"] > 20 and balanced["grad_norm"] > 0, balanced
    assert balanced["imbalance"] < balanced["imbalance_rolled_out"] - 0.02, balanced
    assert balanced["unbalanced_keys"] == 0.0, balanced
    # MoE at EP=2 vs EP=1: the same samples (rewards equal), gradients equal up to summation order (float32)
    moe_ep = _reported(out, "moe_ep ")
    assert moe_ep["reward_diff"] == 0.0 and moe_ep["same_keys"] == 1.0, moe_ep
    assert moe_ep["grad_norm_rel"] <= 1e-6 and 1.0 <= moe_ep["load_imbalance_ep2"] <= 2.0, moe_ep
    # PP=2 x EP=2 rolled out at rollout.tp=1 (experts regrouped over stages and EP ranks) equals EP=1
    moe_pp2 = _reported(out, "moe_ep_pp2 ")
    assert moe_pp2["reward_diff"] == 0.0 and moe_pp2["same_keys"] == 1.0, moe_pp2
    assert moe_pp2["grad_norm_rel"] <= 1e-6, moe_pp2  # float32: the EP split changes summation order only
    # step 2 (after an update): the rollout's log-probs still equal training's, and every parameter megatron
    # replicates over TP (norms, routers, routed experts at EP=1) is bit-equal on the TP ranks; under SP each
    # TP rank routes its own tokens, so expert gradients must be summed over TP x DP (float32, as dense)
    for report in (moe_ep, moe_pp2):
        assert report["rollout_kl_step2"] <= 1e-6 and report["tp_replica_max_diff"] == 0.0, report
    assert moe_ep["tp_replicas_checked"] > 0, moe_ep
    # trainer.export_hf at EP=2 (TP=2 x SP, and PP=2): every rank's trained experts are in the export, bit
    # for bit (tiny_moe: 2 layers x 4 experts x gate/up/down, each held by at least one rank), and
    # transformers loads it as a Qwen3-MoE
    from transformers import AutoModelForCausalLM

    for report in (moe_ep, moe_pp2):
        assert report["ep2_experts_exported"] == report["ep2_experts_checked"] >= 2 * 4 * 3, report
        model = AutoModelForCausalLM.from_pretrained(report["ep2_export_dir"], dtype=torch.float32)
        assert type(model).__name__ == "Qwen3MoeForCausalLM"
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()
    ppo = [json.loads(line) for line in (tmp_path / "ppo_tp2_pp2" / "metrics.jsonl").read_text().splitlines()]
    assert "val/reward_mean" in ppo[-1]
    assert all(row["actor/reward_kl_coef"] == 0.001 for row in ppo)
    dapo = [
        json.loads(line)
        for line in (tmp_path / "dapo_tp2_dp2_budget" / "metrics.jsonl").read_text().splitlines()
    ]
    grpo_padded = [
        json.loads(line)
        for line in (tmp_path / "grpo_reward_model_tp2_pp2" / "metrics.jsonl").read_text().splitlines()
    ]
    # the update's padding: packed by default (SP rounds each micro-batch up to a multiple of tp=2, at most
    # one token each; no SP: none); trainer.pack_sequences=false pads rows to the batch's longest
    for rows, low, high in ((ppo, 0.0, 0.05), (dapo, 0.0, 0.0), (grpo_padded, 1e-9, 1.0)):
        assert all(low <= row["perf/padding_fraction"] <= high for row in rows), [
            r["perf/padding_fraction"] for r in rows
        ]
    # tokens processed per micro-batch of the update: under the 80-token budget (no single row is longer)
    assert all(0 < row["perf/tokens_per_micro_batch"] <= 80 for row in dapo), dapo
    assert all(row["perf/tokens_per_micro_batch"] > 0 for row in ppo + grpo_padded)
    for row in dapo:
        assert row["dynamic_sampling/generated_groups"] >= 4  # data.batch_size over both replicas
        assert row["dynamic_sampling/dropped_groups"] <= row["dynamic_sampling/generated_groups"]
