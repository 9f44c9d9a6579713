"""KL estimators, KL in the reward and the KL controllers: hand-computed examples, masking, bad input."""

import math

import pytest
import torch

from algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    get_kl_estimator,
    kl_estimator_names,
    make_kl_controller,
    scores_to_token_rewards,
)
from algorithms.losses import agg_loss, loss_normalizer

F64 = torch.float64
GARBAGE = 1e30


def t(x):
    return torch.tensor(x, dtype=F64)


def test_estimators_hand_example():
    # d = log_probs - ref = 0 - ln 2 = -0.6931472; third token is padding with garbage
    log_probs, ref = t([[0.0, 0.0, GARBAGE]]), t([[math.log(2.0), 0.0, -GARBAGE]])
    mask = torch.tensor([[1, 1, 0]])
    expected = {
        "k1": -0.6931472,  # d
        "abs": 0.6931472,  # |d|
        "k2": 0.2402265,  # d^2 / 2 = 0.480453 / 2
        "k3": 0.3068528,  # exp(-d) - 1 + d = 2 - 1 - 0.6931472
    }
    for name, value in expected.items():
        kl = get_kl_estimator(name)(log_probs, ref, mask)
        torch.testing.assert_close(kl, t([[value, 0.0, 0.0]]), atol=1e-7, rtol=0)


def test_k3_is_clamped_to_ten():
    # ref - actor = 20: exp(20) - 20 - 1 is huge, clamped to 10 (as verl's low_var_kl)
    kl = get_kl_estimator("k3")(t([[0.0]]), t([[20.0]]), torch.ones(1, 1))
    assert kl.item() == 10.0


@pytest.mark.parametrize("name", kl_estimator_names())
def test_estimators_ignore_padding_and_give_zero_grad_there(name):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    log_probs, ref = -torch.rand(2, 4, dtype=F64), -torch.rand(2, 4, dtype=F64)
    dirty_lp = torch.where(mask.bool(), log_probs, t(GARBAGE)).requires_grad_()
    dirty_ref = torch.where(mask.bool(), ref, t(-GARBAGE))
    clean_lp = log_probs.clone().requires_grad_()
    clean = get_kl_estimator(name)(clean_lp, ref, mask)
    dirty = get_kl_estimator(name)(dirty_lp, dirty_ref, mask)
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)
    assert (dirty[~mask.bool()] == 0).all()
    # KL as a loss term: estimator + agg_loss
    for kl in (clean, dirty):
        agg_loss(kl, mask, "token-mean", loss_normalizer(mask, "token-mean")).backward()
    torch.testing.assert_close(dirty_lp.grad, clean_lp.grad, atol=0, rtol=0)
    assert (dirty_lp.grad[~mask.bool()] == 0).all()


def test_scores_to_token_rewards_hand_example():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    kl = t([[0.1, 0.2, GARBAGE], [0.3, 0.4, 0.5], [GARBAGE, GARBAGE, GARBAGE]])
    rewards = scores_to_token_rewards(t([1.0, 2.0, 7.0]), mask, kl_bt=kl, kl_coef=0.5)
    # row 0: -0.05, 1 - 0.1 = 0.9, pad; row 1: -0.15, -0.2, 2 - 0.25 = 1.75; row 2 has no valid token
    expected = t([[-0.05, 0.9, 0.0], [-0.15, -0.2, 1.75], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected, atol=1e-12, rtol=0)
    no_kl = scores_to_token_rewards(t([1.0, 2.0, 7.0]), mask)
    torch.testing.assert_close(no_kl, t([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]), atol=0, rtol=0)


def test_adaptive_controller_hand_example():
    ctrl = make_kl_controller("adaptive", kl_coef=0.1, target=6.0, horizon=10000)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(current_kl=9.0, n_steps=1000)
    # error = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2; multiplier 1 + 0.2 * 1000/10000 = 1.02 -> 0.102
    assert ctrl.value == pytest.approx(0.102, abs=1e-15)
    ctrl.update(current_kl=5.7, n_steps=1000)
    # error = 5.7/6 - 1 = -0.05 (inside the clip); multiplier 1 - 0.005 = 0.995 -> 0.10149
    assert ctrl.value == pytest.approx(0.10149, abs=1e-15)
    restored = make_kl_controller("adaptive", kl_coef=0.1, target=6.0, horizon=10000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    # a resume that starts from another coefficient, or from a fixed controller's state, uses its own
    # (the checkpoint's coefficient silently replaced the configured one)
    for state in (ctrl.state_dict(), make_kl_controller("fixed", kl_coef=0.1).state_dict()):
        other = make_kl_controller("adaptive", kl_coef=0.5, target=6.0, horizon=10000)
        other.load_state_dict(state)
        assert other.value == 0.5


def test_fixed_controller_never_moves():
    ctrl = make_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=100.0, n_steps=10**6)
    assert ctrl.value == 0.05
    resumed = make_kl_controller("fixed", kl_coef=0.5)  # a resume with another coefficient uses its own
    resumed.load_state_dict(ctrl.state_dict())
    assert resumed.value == 0.5


def test_bad_input():
    assert kl_estimator_names() == ["abs", "k1", "k2", "k3"]
    with pytest.raises(ValueError, match=r"kl_estimator='full'.*abs, k1, k2, k3"):
        get_kl_estimator("full")
    with pytest.raises(ValueError, match=r"kl_ctrl='pid'.*fixed, adaptive"):
        make_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_target"):
        make_kl_controller("adaptive", kl_coef=0.1, target=0.0)
    with pytest.raises(ValueError, match="ref_log_probs_bt"):
        get_kl_estimator("k3")(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="scores_b"):
        scores_to_token_rewards(torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="kl_bt"):
        scores_to_token_rewards(torch.zeros(2), torch.ones(2, 3), kl_bt=torch.zeros(2, 2), kl_coef=0.1)
