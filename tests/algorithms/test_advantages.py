"""Advantage estimators: hand-computed examples, invariants, masking, bad input. CPU, float64."""

import threading

import pytest
import torch

from algorithms.advantages import advantage_estimator_names, get_advantage_estimator

F64 = torch.float64
GARBAGE = 1e30  # huge but finite: must not reach any valid output


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def run(name, **kwargs):
    return get_advantage_estimator(name)(**kwargs)


# Six responses to three prompts, groups interleaved (not adjacent): prompt 7 -> rows 0, 2, 4;
# prompt 3 -> rows 1, 3; prompt 9 -> row 5 (a group of one). resp_len 4; valid lengths 1, 4, 2, 3, 2, 4.
SCORES = t([1.0, 2.0, 0.0, 4.0, 0.5, 5.0])
GROUPS = torch.tensor([7, 3, 7, 3, 7, 9])
MASK = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])


def assert_broadcast(adv_bt, expected_b, atol=1e-9):
    """Each row equals its expected value on valid tokens and exactly 0 on padding."""
    expected_bt = torch.where(MASK.bool(), t(expected_b).unsqueeze(-1), t(0.0))
    torch.testing.assert_close(adv_bt, expected_bt, atol=atol, rtol=0)
    assert (adv_bt[~MASK.bool()] == 0).all()


def test_grpo_hand_example():
    adv, returns = run("grpo", mask_bt=MASK, scores_b=SCORES, group_index_b=GROUPS)
    # prompt 7: scores 1, 0, 0.5 -> mean 0.5, unbiased var (0.25 + 0.25 + 0) / 2 = 0.25, std 0.5 -> 1, -1, 0
    # prompt 3: scores 2, 4 -> mean 3, var (1 + 1) / 1 = 2, std sqrt(2) -> -1/sqrt(2), +1/sqrt(2)
    # prompt 9: alone, no baseline -> its score 5 (divided by std 1 + eps)
    r = 0.7071067811865476
    assert_broadcast(adv, [1.0, -r, -1.0, r, 0.0, 5.0], atol=1e-5)  # eps=1e-6 in the denominator
    assert_broadcast(returns, SCORES.tolist())


def test_grpo_group_of_equal_float32_rewards_gets_exactly_zero():
    """A group whose rewards are all equal gets advantage 0 (no biased update), also for rewards float32 does
    not sum exactly (0.7, reward-model scores): before, the float32 group mean's rounding residual divided by
    the std (~ the residual) gave +0.106 to all 16 members of a 0.7 group."""
    for n, value in ((16, 0.7), (64, -3.3), (5, 0.1)):
        scores = torch.full((n,), value, dtype=torch.float32)
        mask = torch.ones(n, 3, dtype=torch.float32)
        for norm in (True, False):
            adv, _ = run(
                "grpo",
                mask_bt=mask,
                scores_b=scores,
                group_index_b=torch.zeros(n, dtype=torch.long),
                norm_by_std=norm,
            )
            assert adv.dtype == torch.float32 and (adv == 0).all(), (n, value, norm, adv[0, 0].item())


def test_dr_grpo_no_std_hand_example():
    adv, _ = run("grpo", mask_bt=MASK, scores_b=SCORES, group_index_b=GROUPS, norm_by_std=False)
    # score - group mean: prompt 7 mean 0.5, prompt 3 mean 3, prompt 9 alone
    assert_broadcast(adv, [0.5, -1.0, -0.5, 1.0, 0.0, 5.0])


def test_rloo_hand_example():
    adv, _ = run("rloo", mask_bt=MASK, scores_b=SCORES, group_index_b=GROUPS)
    # prompt 7: 1 - (0 + 0.5)/2 = 0.75; 0 - (1 + 0.5)/2 = -0.75; 0.5 - (1 + 0)/2 = 0
    # prompt 3: 2 - 4 = -2; 4 - 2 = 2; prompt 9 alone: 5
    assert_broadcast(adv, [0.75, -2.0, -0.75, 2.0, 0.0, 5.0])


def test_opo_hand_example():
    adv, _ = run("opo", mask_bt=MASK, scores_b=SCORES, group_index_b=GROUPS)
    # prompt 7: lengths 1, 2, 2; baseline (1*1 + 2*0 + 2*0.5) / 5 = 0.4 -> 0.6, -0.4, 0.1
    # prompt 3: lengths 4, 3; baseline (4*2 + 3*4) / 7 = 20/7 -> 2 - 20/7 = -6/7, 4 - 20/7 = 8/7
    assert_broadcast(adv, [0.6, -6 / 7, -0.4, 8 / 7, 0.1, 5.0])


def test_remax_hand_example():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rewards = t([[0.0, 1.0, GARBAGE], [0.0, GARBAGE, GARBAGE]])  # the score at the last valid token
    adv, ret = run("remax", mask_bt=mask, token_rewards_bt=rewards, baseline_scores_b=t([0.5, 0.5]))
    torch.testing.assert_close(adv, t([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]]), atol=0, rtol=0)
    torch.testing.assert_close(ret, t([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), atol=0, rtol=0)


def test_remax_with_kl_in_the_reward_is_verls_reward_to_go():
    """Score 1, baseline 0.5, KL penalties 0.1, 0.2, 0.3 (the last token's reward 1 - 0.3): verl's
    compute_remax_outcome_advantage gives reward-to-go minus baseline per token, [0.4, 0.5, 0.7] - 0.5; the
    KL-shaped sequence reward minus the baseline would be -0.1 on every token."""
    mask = torch.tensor([[1, 1, 1, 0]])
    rewards = t([[-0.1, -0.2, 0.7, 0.0]])
    kwargs = dict(mask_bt=mask, token_rewards_bt=rewards, baseline_scores_b=t([0.5]))
    adv, ret = run("remax", scores_b=rewards.sum(-1), **kwargs)  # what engine/step/advantages.py passes
    torch.testing.assert_close(adv, t([[-0.1, 0.0, 0.2, 0.0]]), atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, t([[0.4, 0.5, 0.7, 0.0]]), atol=1e-12, rtol=0)


def test_reinforce_pp_baseline_hand_example():
    mask = torch.tensor([[1, 0], [1, 1], [1, 0], [1, 1]])
    adv, _ = run(
        "reinforce_pp_baseline",
        mask_bt=mask,
        scores_b=t([1.0, 0.0, 3.0, 1.0]),
        group_index_b=torch.tensor([0, 0, 1, 1]),
    )
    # minus group mean: 0.5, -0.5, 1, -1; over tokens: 0.5 | -0.5 -0.5 | 1 | -1 -1 (6 tokens)
    # token mean -1.5/6 = -0.25; deviations .75 -.25 -.25 1.25 -.75 -.75; sum of squares 3.375;
    # unbiased var 3.375/5 = 0.675; std 0.8215838 -> 0.9128709, -0.3042903, 1.5214515, -0.9128709
    expected = t([[0.9128709, 0.0], [-0.3042903, -0.3042903], [1.5214515, 0.0], [-0.9128709, -0.9128709]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_reinforce_pp_hand_example():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards = t([[0.1, 0.0, 1.0], [0.0, 2.0, GARBAGE]])
    adv, returns = run("reinforce_pp", mask_bt=mask, token_rewards_bt=rewards, gamma=0.5)
    # returns-to-go with gamma 0.5: row 0: 0.1 + 0.5*0.5 = 0.35, 0 + 0.5*1 = 0.5, 1; row 1: 0 + 0.5*2 = 1, 2
    torch.testing.assert_close(returns, t([[0.35, 0.5, 1.0], [1.0, 2.0, 0.0]]), atol=1e-12, rtol=0)
    # whitened over 5 tokens: mean 0.97, unbiased var 1.668/4 = 0.417, std 0.6457554
    expected = t([[-0.9601159, -0.7278298, 0.0464572], [0.0464572, 1.5950313, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


class ShardSum:
    """`reduce_sum` for shards of one batch run in threads: each call waits for every shard's tensor and
    returns their sum (what an all_reduce over DP does across processes)."""

    def __init__(self, num_shards: int):
        self.barrier = threading.Barrier(num_shards)
        self.parts: dict[int, torch.Tensor] = {}

    def of(self, shard: int):
        def reduce_sum(x):
            self.parts[shard] = x
            self.barrier.wait()
            total = sum(self.parts[i] for i in sorted(self.parts))
            self.barrier.wait()  # every shard has read this round before the next one writes
            return total

        return reduce_sum


def run_sharded(name, row_slices, **kwargs):
    """Run estimator `name` on row shards of the batch in threads joined by `ShardSum`; outputs re-concatenated."""
    sums, outs = ShardSum(len(row_slices)), [None] * len(row_slices)

    def shard(i, rows):
        part = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        outs[i] = run(name, **part, reduce_sum=sums.of(i))

    threads = [threading.Thread(target=shard, args=(i, rows)) for i, rows in enumerate(row_slices)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def test_reinforce_pp_whitening_over_dp_shards_hand_example():
    """Each row on its own shard (DP=2): whitened with the whole batch's statistics, as on one shard."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards = t([[0.1, 0.0, 1.0], [0.0, 2.0, GARBAGE]])
    adv, returns = run_sharded(
        "reinforce_pp", [slice(0, 1), slice(1, 2)], mask_bt=mask, token_rewards_bt=rewards, gamma=0.5
    )
    torch.testing.assert_close(returns, t([[0.35, 0.5, 1.0], [1.0, 2.0, 0.0]]), atol=1e-12, rtol=0)
    # the whole batch's 5 tokens: mean 0.97, unbiased var 1.668/4 = 0.417 (verl's masked_whiten); shard 0
    # alone would give mean 0.6167, var 0.1158 and -0.7835 for its first token
    expected = t([[-0.9601159, -0.7278298, 0.0464572], [0.0464572, 1.5950313, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["gae", "reinforce_pp", "reinforce_pp_baseline"])
def test_whitening_does_not_depend_on_the_dp_split(name):
    """16 rows as 1 x 16, 2 x 8 and 4 x 4 shards (one shard all padding): the same advantages, float32."""
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(6) < torch.randint(1, 7, (16, 1), generator=gen)).long()
    mask[4:8] = 0  # a shard with no valid token still takes part in the sums
    inputs = dict(
        mask_bt=mask,
        scores_b=torch.randn(16, generator=gen),
        group_index_b=torch.arange(16) // 4,
        token_rewards_bt=torch.randn(16, 6, generator=gen),
        values_bt=torch.randn(16, 6, generator=gen),
        gamma=0.9,
        lam=0.8,
    )
    whole = run(name, **inputs)
    local = run(name, **{k: (v[:8] if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})[0]
    assert (local - whole[0][:8]).abs().max() > 0.05  # per-shard statistics would differ
    for num_shards in (1, 2, 4):
        rows = 16 // num_shards
        shards = [slice(i * rows, (i + 1) * rows) for i in range(num_shards)]
        adv, returns = run_sharded(name, shards, **inputs)
        torch.testing.assert_close(adv, whole[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(returns, whole[1], atol=0, rtol=0)


def test_gae_hand_example():
    mask = torch.tensor([[1, 1, 1, 0]])
    rewards, values = t([[0.0, 0.0, 1.0, GARBAGE]]), t([[0.5, 0.6, 0.7, GARBAGE]])
    adv, returns = run(
        "gae", mask_bt=mask, token_rewards_bt=rewards, values_bt=values, gamma=0.9, lam=0.8, whiten=False
    )
    # t=2: delta = 1 + 0 - 0.7 = 0.3, A = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03, A = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04, A = 0.04 + 0.72*0.246 = 0.21712
    torch.testing.assert_close(adv, t([[0.21712, 0.246, 0.3, 0.0]]), atol=1e-12, rtol=0)
    torch.testing.assert_close(returns, t([[0.71712, 0.846, 1.0, 0.0]]), atol=1e-12, rtol=0)


def test_gae_whitening_switch():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    rewards, values = torch.rand(2, 4, dtype=F64), torch.rand(2, 4, dtype=F64)
    raw, _ = run("gae", mask_bt=mask, token_rewards_bt=rewards, values_bt=values, whiten=False)
    white, _ = run("gae", mask_bt=mask, token_rewards_bt=rewards, values_bt=values, whiten=True)
    valid = raw[mask.bool()]
    torch.testing.assert_close(white[mask.bool()], (valid - valid.mean()) / valid.std(), atol=1e-6, rtol=0)
    assert (white[~mask.bool()] == 0).all()


# ---------------------------------------------------------------------------------------------------------
# invariants


def test_gae_lambda_one_gamma_one_is_returns_minus_values():
    torch.manual_seed(0)
    mask = (torch.arange(6) < torch.tensor([[6], [3], [1], [5]])).long()
    rewards, values = torch.randn(4, 6, dtype=F64), torch.randn(4, 6, dtype=F64)
    adv, _ = run(
        "gae", mask_bt=mask, token_rewards_bt=rewards, values_bt=values, gamma=1.0, lam=1.0, whiten=False
    )
    masked_rewards = rewards * mask
    reward_to_go = masked_rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv, (reward_to_go - values) * mask, atol=1e-12, rtol=0)


def test_gae_skips_holes_inside_a_response():
    """A masked position in the middle (multi-turn observation) acts as if it were not there."""
    rewards, values = t([[0.2, 9.0, 0.0, 1.0]]), t([[0.5, 9.0, 0.6, 0.7]])
    holed, _ = run(
        "gae",
        mask_bt=torch.tensor([[1, 0, 1, 1]]),
        token_rewards_bt=rewards,
        values_bt=values,
        whiten=False,
        gamma=0.9,
        lam=0.8,
    )
    compact, _ = run(
        "gae",
        mask_bt=torch.ones(1, 3),
        token_rewards_bt=rewards[:, [0, 2, 3]],
        values_bt=values[:, [0, 2, 3]],
        whiten=False,
        gamma=0.9,
        lam=0.8,
    )
    torch.testing.assert_close(holed[:, [0, 2, 3]], compact, atol=1e-12, rtol=0)
    assert holed[0, 1] == 0


def test_grpo_zero_mean_per_group_and_unit_std():
    torch.manual_seed(1)
    groups = torch.randperm(24) % 6  # 6 groups of 4, shuffled
    scores = torch.randn(24, dtype=F64)
    mask = torch.ones(24, 3)
    adv, _ = run("grpo", mask_bt=mask, scores_b=scores, group_index_b=groups, eps=0.0)
    for g in range(6):
        members = adv[groups == g, 0]
        assert abs(members.mean().item()) < 1e-12
        assert abs(members.std().item() - 1.0) < 1e-12


def test_rloo_baseline_excludes_the_sample_itself():
    torch.manual_seed(2)
    groups = torch.tensor([0, 1, 0, 1, 0, 1, 0])
    scores = torch.randn(7, dtype=F64)
    mask = torch.ones(7, 2)
    adv, _ = run("rloo", mask_bt=mask, scores_b=scores, group_index_b=groups)
    for i in range(7):
        others = [scores[j].item() for j in range(7) if groups[j] == groups[i] and j != i]
        assert abs(adv[i, 0].item() - (scores[i].item() - sum(others) / len(others))) < 1e-12
    # moving sample 0's score moves its own advantage by exactly that amount (its baseline does not see it)
    bumped = scores.clone()
    bumped[0] += 3.0
    adv2, _ = run("rloo", mask_bt=mask, scores_b=bumped, group_index_b=groups)
    assert abs(adv2[0, 0].item() - adv[0, 0].item() - 3.0) < 1e-12
    assert abs(adv2[2, 0].item() - adv[2, 0].item() + 1.0) < 1e-12  # other members: -3/(n-1), n = 4


def test_group_order_does_not_matter():
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    for name in ("grpo", "rloo", "opo", "reinforce_pp_baseline"):
        adv, _ = run(name, mask_bt=MASK, scores_b=SCORES, group_index_b=GROUPS)
        adv_p, _ = run(name, mask_bt=MASK[perm], scores_b=SCORES[perm], group_index_b=GROUPS[perm])
        torch.testing.assert_close(adv_p, adv[perm], atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# masks, common signature, bad input


def _everything(mask, garbage):
    torch.manual_seed(3)
    rewards, values = torch.randn(6, 4, dtype=F64), torch.randn(6, 4, dtype=F64)
    if garbage:
        rewards = torch.where(mask.bool(), rewards, t(GARBAGE))
        values = torch.where(mask.bool(), values, t(-GARBAGE))
    return dict(
        mask_bt=mask,
        scores_b=SCORES,
        group_index_b=GROUPS,
        token_rewards_bt=rewards,
        values_bt=values,
        baseline_scores_b=SCORES.flip(0),
        gamma=0.95,
        lam=0.9,
    )


@pytest.mark.parametrize("name", advantage_estimator_names())
def test_padding_garbage_changes_nothing(name):
    clean = run(name, **_everything(MASK, garbage=False))
    dirty = run(name, **_everything(MASK, garbage=True))
    for a, b in zip(clean, dirty):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        assert torch.isfinite(b).all() and (b[~MASK.bool()] == 0).all()


@pytest.mark.parametrize("name", advantage_estimator_names())
def test_common_signature_and_bool_or_float_mask(name):
    a = run(name, **_everything(MASK.bool(), garbage=False))
    b = run(name, **_everything(MASK.to(F64), garbage=False))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert a[0].shape == MASK.shape and a[1].shape == MASK.shape


def test_known_names():
    assert advantage_estimator_names() == sorted(
        ["gae", "grpo", "rloo", "opo", "reinforce_pp", "reinforce_pp_baseline", "remax"]
    )


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match=r"adv_estimator='ppo'.*gae, grpo"):
        get_advantage_estimator("ppo")


@pytest.mark.parametrize(
    ("name", "override", "arg"),
    [
        ("grpo", {"scores_b": t([1.0, 2.0])}, "scores_b"),
        ("grpo", {"group_index_b": GROUPS[:5]}, "group_index_b"),
        ("grpo", {"group_index_b": GROUPS.to(F64)}, "group_index_b"),
        ("rloo", {"scores_b": None}, "scores_b"),
        ("gae", {"values_bt": torch.zeros(6, 5, dtype=F64)}, "values_bt"),
        ("gae", {"values_bt": None}, "values_bt"),
        ("reinforce_pp", {"token_rewards_bt": torch.zeros(6, dtype=F64)}, "token_rewards_bt"),
        ("remax", {"baseline_scores_b": None}, "baseline_scores_b"),
        ("remax", {"token_rewards_bt": None}, "token_rewards_bt"),
        ("opo", {"mask_bt": torch.ones(6)}, "mask_bt"),
    ],
)
def test_bad_input_names_the_argument(name, override, arg):
    kwargs = _everything(MASK, garbage=False)
    kwargs.update(override)
    with pytest.raises(ValueError, match=arg):
        run(name, **kwargs)
