"""Hand-checked wiring of the algorithm config into the trainer's pure parts (no processes): advantages on a
tiny fixed batch equal the algorithms/ functions', KL in the reward is charged once per token, dynamic
sampling drops exactly the constant-reward groups, values and log-probs read the same positions, the
config checks name their keys, and the FLOPs count matches a hand count.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from trainer_jobs import compose_config

from algorithms.advantages import get_advantage_estimator
from algorithms.kl import get_kl_estimator
from engine.config import AlgorithmConfig, ConfigError
from engine.models.builder import ModelShape
from engine.roles.dynamic_batch import MicroBatcher
from engine.roles.policy import ResponseStats
from engine.step.advantages import compute_advantages
from engine.step.batch import Responses, build_experience
from engine.step.dynamic_sampling import GroupSelector, global_order, replica_share
from engine.step.losses import make_actor_loss, response_values
from engine.step.perf import matmul_params, train_flops
from engine.validate import validate

LENGTHS = [3, 2, 4, 1, 2, 4]  # 3 prompts x n=2
SCORES = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 1.0])


def tiny_experience():
    """3 prompts of lengths 2, 3, 4 with n=2 responses each (T=4), fixed scores and log-probs."""
    prompts = [[5, 6], [7, 8, 9], [10, 11, 12, 13]]
    mask = (torch.arange(4) < torch.tensor(LENGTHS)[:, None]).float()
    response_ids = (torch.arange(24).view(6, 4) % 20 + 20) * mask.long()
    rollout_lp = -0.1 * torch.arange(1, 25, dtype=torch.float32).view(6, 4) * mask
    exp = build_experience(prompts, response_ids, mask, [0, 1, 2], 2, pad_id=0)
    exp.tensors["scores"] = SCORES.clone()
    exp.tensors["rollout_log_probs"] = rollout_lp
    exp.tensors["ref_log_probs"] = rollout_lp * 0.5
    return exp


def composed(*overrides: str):
    return compose_config(list(overrides))


def alg(**kw) -> AlgorithmConfig:
    return replace(AlgorithmConfig(), **kw)


def test_grpo_groups_are_the_rows_of_one_prompt():
    exp = tiny_experience()
    assert exp.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    out = compute_advantages(exp, alg(adv_estimator="grpo"), kl_coef=0.0)
    expected, _ = get_advantage_estimator("grpo")(
        mask_bt=exp.response_mask, scores_b=SCORES, group_index_b=torch.tensor([0, 0, 1, 1, 2, 2])
    )
    torch.testing.assert_close(out["advantages"], expected, rtol=0, atol=0)
    # group 1 scored 0.5 twice: zero advantage; the others are +-1/sqrt(2) (Bessel std) on valid tokens
    assert out["advantages"][2:4].abs().max() == 0
    torch.testing.assert_close(out["advantages"][0, :3], torch.full((3,), 0.5**0.5), rtol=1e-5, atol=1e-5)


def test_kl_in_reward_is_charged_once_per_token():
    exp = tiny_experience()
    coef = 0.1
    out = compute_advantages(exp, alg(adv_estimator="rloo", kl_in_reward=True, kl_estimator="k1"), coef)
    mask = exp.response_mask
    kl = (exp.tensors["rollout_log_probs"] - exp.tensors["ref_log_probs"]) * mask  # on-policy: rollout lp
    torch.testing.assert_close(out["kl"], kl)
    last = torch.tensor(LENGTHS) - 1
    expected = -coef * kl
    expected[torch.arange(6), last] += SCORES
    torch.testing.assert_close(out["token_rewards"], expected)
    torch.testing.assert_close(out["token_rewards"].sum(-1), SCORES - coef * kl.sum(-1))
    rloo, _ = get_advantage_estimator("rloo")(
        mask_bt=mask, scores_b=SCORES - coef * kl.sum(-1), group_index_b=exp.group_index
    )
    torch.testing.assert_close(out["advantages"], rloo)
    torch.testing.assert_close(out["kl_seq"], kl.sum(-1) / mask.sum(-1))


def test_kl_in_reward_uses_the_old_log_probs_when_that_forward_ran():
    exp = tiny_experience()
    exp.tensors["old_log_probs"] = exp.tensors["rollout_log_probs"] - 0.25 * exp.response_mask
    out = compute_advantages(exp, alg(adv_estimator="grpo", kl_in_reward=True, kl_estimator="k2"), 0.5)
    expected = get_kl_estimator("k2")(
        exp.tensors["old_log_probs"], exp.tensors["ref_log_probs"], exp.response_mask
    )
    torch.testing.assert_close(out["kl"], expected)


def test_token_reward_estimators_and_overlong_shaping():
    exp = tiny_experience()
    exp.tensors["overlong_penalty"] = torch.tensor([0.0, -0.5, 0.0, 0.0, -1.0, 0.0])
    shaped = SCORES + exp.tensors["overlong_penalty"]
    mask = exp.response_mask
    out = compute_advantages(exp, alg(adv_estimator="reinforce_pp", gamma=0.9), 0.0)
    last = torch.tensor(LENGTHS) - 1
    rewards = torch.zeros(6, 4)
    rewards[torch.arange(6), last] = shaped
    expected, returns = get_advantage_estimator("reinforce_pp")(
        mask_bt=mask, token_rewards_bt=rewards, gamma=0.9
    )
    torch.testing.assert_close(out["advantages"], expected)
    torch.testing.assert_close(returns[0, :3], shaped[0] * torch.tensor([0.81, 0.9, 1.0]))
    exp.tensors["values"] = 0.1 * torch.arange(24, dtype=torch.float32).view(6, 4)
    out = compute_advantages(exp, alg(adv_estimator="gae", gamma=1.0, lam=0.95), 0.0)
    gae, gae_returns = get_advantage_estimator("gae")(
        mask_bt=mask, token_rewards_bt=rewards, values_bt=exp.tensors["values"], gamma=1.0, lam=0.95
    )
    torch.testing.assert_close(out["advantages"], gae)
    torch.testing.assert_close(out["returns"], gae_returns)


def test_remax_subtracts_the_greedy_baseline():
    exp = tiny_experience()
    exp.tensors["baseline_scores"] = torch.tensor([0.5, 0.5, 1.0, 1.0, 0.0, 0.0])
    out = compute_advantages(exp, alg(adv_estimator="remax"), 0.0)
    expected = (SCORES - exp.tensors["baseline_scores"])[:, None] * exp.response_mask
    torch.testing.assert_close(out["advantages"], expected)


def responses(scores: list[float], n: int = 2, tag: int = 0) -> Responses:
    rows = len(scores)
    records = [("prompt", tag, g) for g in range(rows // n)]
    ids = torch.arange(rows)[:, None].repeat(1, 3) + 100 * tag
    return Responses(
        records=records,
        n=n,
        response_ids=ids,
        response_mask=torch.ones(rows, 3),
        log_probs=torch.zeros(rows, 3),
        finished=torch.ones(rows),
        scores=torch.tensor(scores),
    )


def test_dynamic_sampling_drops_exactly_the_constant_groups_and_refills():
    selector = GroupSelector(num_groups=3)
    selector.add(responses([1.0, 1.0, 0.0, 1.0, 0.5, 0.5], tag=0))  # groups: constant, varied, constant
    assert selector.missing == 2
    selector.add(responses([0.0, 0.0, 0.2, 0.7, 0.3, 0.1], tag=1))  # constant, varied, varied
    assert selector.missing == 0
    batch, stats = selector.finish()
    assert batch.records == [("prompt", 0, 1), ("prompt", 1, 1), ("prompt", 1, 2)]
    assert batch.scores.tolist() == pytest.approx([0.0, 1.0, 0.2, 0.7, 0.3, 0.1])
    assert batch.response_ids[:, 0].tolist() == [2, 3, 102, 103, 104, 105]
    assert stats == {"generated": 6, "dropped": 3, "filler": 0}


def test_dynamic_sampling_fills_with_dropped_groups_at_the_round_cap():
    selector = GroupSelector(num_groups=3)
    selector.add(responses([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]))
    batch, stats = selector.finish()
    assert batch.num_groups == 3 and stats == {"generated": 3, "dropped": 2, "filler": 2}
    assert batch.records[0] == ("prompt", 0, 1)  # informative groups first


def test_dynamic_sampling_sees_the_overlong_penalty():
    r = responses([1.0, 1.0, 0.0, 1.0])
    r.overlong_penalty = torch.tensor([0.0, -0.5, 0.0, 0.0])  # group 0 now differs
    selector = GroupSelector(num_groups=2)
    selector.add(r)
    assert selector.missing == 0


def test_dynamic_sampling_chooses_the_same_mini_batches_at_every_dp_size():
    """8 prompts x n=2 per round, 2 mini-batches; the selection runs on all replicas' responses (gathered,
    here handed over directly), so DP=1, 2 and 4 train on the same groups in the same mini-batches."""
    rounds = [
        responses([0.0, 1, 1, 0, 0, 2, 1, 3, 1, 1, 0, 1, 2, 2, 0, 0], tag=0),  # 0, 1, 2, 3, 5 vary
        responses([0.0, 1, 1, 1, 1, 0, 0, 0, 2, 1, 0, 0, 1, 0, 3, 3], tag=1),  # 0, 2, 4, 6 vary
    ]

    def minis(dp: int) -> list[list]:
        selector = GroupSelector(num_groups=8)
        for round_ in rounds:  # replica r holds the loader's share of each mini-batch's slice
            per_rank = 4 // dp
            parts = [
                round_.select([i + r * per_rank + j for i in (0, 4) for j in range(per_rank)])
                for r in range(dp)
            ]
            selector.add(global_order(parts, num_mini_batches=2))
        batch, stats = selector.finish()
        assert stats == {"generated": 16, "dropped": 7, "filler": 0}
        shares = [replica_share(batch, r, dp, num_mini_batches=2).records for r in range(dp)]
        per_rank = 4 // dp
        return [sum((share[i * per_rank : (i + 1) * per_rank] for share in shares), []) for i in (0, 1)]

    # the first 8 informative groups of the global order (per-replica quotas would take round 1's group 6)
    expected = [
        [("prompt", 0, g) for g in (0, 1, 2, 3)],
        [("prompt", 0, 5), ("prompt", 1, 0), ("prompt", 1, 2), ("prompt", 1, 4)],
    ]
    assert minis(1) == expected
    assert minis(2) == expected
    assert minis(4) == expected


def test_values_and_log_probs_read_the_same_positions():
    exp = tiny_experience()
    (mb,) = MicroBatcher(6, 0, 1, torch.device("cpu"))(exp, torch.arange(6))
    seq = mb["tokens"].shape[1]
    positions = torch.arange(seq, dtype=torch.float32)[None, :, None].expand(6, seq, 1)
    values = response_values(positions, mb)  # (6, T): the position each value was read at
    for r, length in enumerate(LENGTHS):
        p = int(exp.prompt_lens[r])
        assert values[r, :length].tolist() == [p + j - 1 for j in range(length)]
        # the logits at that position predict response token j, at sequence position p + j
        assert torch.equal(mb["tokens"][r, p : p + length], exp.response_ids[r, :length])


PRESETS = ["ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "remax", "gspo"]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_validates_on_the_default_job(preset):
    extra = ["rollout.max_new_tokens=6"] if preset == "dapo" else []  # the buffer after the 5-token answer
    validate(composed(f"algorithm={preset}", *extra), world_size=1)


BAD = [
    # DAPO's 20% buffer of the default job's 5 tokens: the penalty starts inside the 5-token embedded answer
    (["algorithm=dapo"], "algorithm.overlong_buffer_frac=0.2", "raise rollout.max_new_tokens to at least 6"),
    (
        ["algorithm=dapo", "algorithm.overlong_buffer_len=3", "rollout.max_new_tokens=7"],
        "algorithm.overlong_buffer_len=3",
        "every complete answer would be penalized. Fix: raise rollout.max_new_tokens to at least 8",
    ),
    # a 4096-token overlong buffer against the default job's 5-token responses
    (
        ["algorithm=dapo", "algorithm.overlong_buffer_len=4096"],
        "algorithm.overlong_buffer_len=4096",
        "rollout.max_new_tokens=5",
    ),
    (["algorithm.kl_reward_coef=0.01"], "algorithm.kl_reward_coef=0.01", "algorithm.kl_in_reward"),
    (["algorithm.kl_in_reward=true"], "algorithm.kl_reward_coef=0.0", "positive"),
    (
        ["algorithm=ppo", "algorithm.kl_ctrl=adaptive", "algorithm.kl_horizon=0"],
        "algorithm.kl_horizon",
        "> 0",
    ),
    (["algorithm.max_sampling_rounds=0"], "algorithm.max_sampling_rounds", "> 0"),
    (["algorithm.value_clip=-1"], "algorithm.value_clip", ">= 0"),
    (["critic.lr=0"], "critic.lr", "> 0"),
    (["critic.path=/no/such/critic"], "critic.path", "directory"),
    (["trainer.max_tokens_per_micro_batch=32"], "trainer.max_tokens_per_micro_batch=32", "= 70 tokens"),
    (["cluster.peak_tflops=0"], "cluster.peak_tflops", "> 0"),
]


@pytest.mark.parametrize("overrides,key,rule", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_algorithm_config_names_the_key(overrides, key, rule):
    with pytest.raises(ConfigError) as err:
        validate(composed(*overrides), world_size=1)
    assert key in str(err.value) and rule in str(err.value) and "Fix:" in str(err.value)


def test_token_budget_refuses_interleaved_pipelines():
    cfg = composed(
        "trainer.max_tokens_per_micro_batch=256", "parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"
    )
    with pytest.raises(ConfigError, match="parallel.vpp=2"):
        validate(cfg, world_size=2)


def test_flops_hand_count():
    shape = ModelShape(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=192,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        vocab_size=50,
        padded_vocab_size=50,
        max_position_embeddings=256,
        rope_theta=1e4,
        norm_eps=1e-6,
        qkv_bias=False,
        qk_norm=False,
        tie_embeddings=False,
        dtype=torch.float32,
    )
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 192  # q, k+v (2 groups), o, gate/up/down
    assert matmul_params(shape) == 2 * per_layer + 64 * 50
    lens = torch.tensor([10, 20])
    assert train_flops(shape, lens) == 6 * matmul_params(shape) * 30 + 12 * 2 * 64 * (100 + 400)
    # the fused head computes logits at response positions only: 4 + 6 of the 30, the layers at all 30;
    # attention not causal (every query against all keys)
    assert train_flops(shape, lens, torch.tensor([4, 6])) == (
        6 * 2 * per_layer * 30 + 6 * 64 * 50 * 10 + 12 * 2 * 64 * (100 + 400)
    )


def test_actor_loss_terms_are_logged_apart_from_the_total():
    """pg_loss is the policy-gradient term alone, entropy_loss and kl_loss the aggregated terms before their
    coefficients, loss the back-propagated total; each micro-batch returns its share of the mini-batch's.
    Hand count: token-mean over 5 valid tokens, ratio 1 (on-policy), k1 KL = logp - ref."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    ent = torch.tensor([[0.5, 1.0, 9.0], [2.0, 0.5, 1.0]], requires_grad=True)  # 9.0: padding
    a = alg(entropy_coef=0.1, kl_loss_coef=0.5, kl_estimator="k1", loss_agg_mode="token-mean", tis_cap=0.0)
    loss_fn = make_actor_loss(a, 5.0, kl_ref=True, rollout_log_probs=False)
    pg, entropy, kl = (-1 - 1 + 2 + 2 + 2) / 5, (0.5 + 1 + 2 + 0.5 + 1) / 5, (0.5 + 0 + 0.5 - 0.5 + 0) / 5
    expected = {"pg_loss": pg, "entropy_loss": entropy, "kl_loss": kl, "loss": pg - 0.1 * entropy + 0.5 * kl}
    totals = dict.fromkeys(expected, 0.0)
    for rows in ([0], [1]):  # two micro-batches of one mini-batch
        mb = {"response_mask": mask[rows], "advantages": adv[rows], "ref_log_probs": ref[rows]}
        loss, metrics = loss_fn(ResponseStats(logp[rows], ent[rows]), mb)
        assert float(loss) == float(metrics["loss"])
        for key in totals:
            totals[key] += float(metrics[key])
    for key, value in expected.items():
        assert totals[key] == pytest.approx(value, abs=1e-6), key


def test_seq_mean_token_sum_norm_divides_by_the_response_budget():
    """Dr.GRPO's constant (seq-mean-token-sum-norm) is the most tokens of one response: rollout.max_new_tokens,
    and under multi-turn the episode's budget, multi_turn.max_total_tokens, as verl divides by its response
    width, which holds the whole episode (it was one turn's max_new_tokens, scaling multi-turn losses up)."""
    from engine.step.update import loss_max_len

    assert loss_max_len(composed("rollout.max_new_tokens=8")) == 8
    episodes = composed(
        "rollout.max_new_tokens=8", "rollout.multi_turn.enable=true", "rollout.multi_turn.max_total_tokens=40"
    )
    assert loss_max_len(episodes) == 40
