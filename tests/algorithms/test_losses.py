"""Policy/value losses, aggregation and entropy: hand-computed examples, split invariance, masking, bad input.

CPU, float64 unless stated; split-invariance tolerance atol 1e-12 (float64).
"""

import math

import pytest
import torch

from algorithms.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    entropy_from_logits,
    get_policy_loss,
    loss_normalizer,
    policy_loss_names,
    value_loss,
)

F64 = torch.float64
GARBAGE = 1e30


def t(x):
    return torch.tensor(x, dtype=F64)


# ---------------------------------------------------------------------------------------------------------
# aggregation


def test_agg_loss_hand_example_every_mode():
    loss_mat = t([[1.0, 2.0, 3.0], [4.0, 5.0, GARBAGE], [GARBAGE, GARBAGE, GARBAGE]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])  # the last row is all padding: counts for nothing
    expected = {
        "token-mean": (15 / 5, 5.0),  # (1+2+3+4+5) / 5 tokens
        "seq-mean-token-sum": (15 / 2, 2.0),  # (6 + 9) / 2 sequences
        "seq-mean-token-mean": ((2.0 + 4.5) / 2, 2.0),  # (6/3 + 9/2) / 2
        "seq-mean-token-sum-norm": (15 / 8, 8.0),  # 15 / (2 sequences * max_len 4)
    }
    for mode, (loss, normalizer) in expected.items():
        assert loss_normalizer(mask, mode, max_len=4) == normalizer
        assert agg_loss(loss_mat, mask, mode, normalizer).item() == pytest.approx(loss, abs=1e-12)


def test_normalizer_is_additive_over_shards():
    mask = (torch.arange(5) < torch.tensor([[5], [0], [2], [3], [1], [4]])).long()
    for mode in LOSS_AGG_MODES:
        full = loss_normalizer(mask, mode, max_len=9)
        parts = sum(loss_normalizer(mask[i : i + 2], mode, max_len=9) for i in range(0, 6, 2))
        assert full == parts


# ---------------------------------------------------------------------------------------------------------
# policy losses: hand-computed


def _ppo_example():
    # four valid tokens and one padded (garbage) one; ratios 1.5, 0.5, 5, 1; advantages 1, -1, -1, 2
    old = t([[0.0, 0.0, 0.0, 0.0, GARBAGE]])
    log_probs = t([[math.log(1.5), math.log(0.5), math.log(5.0), 0.0, -GARBAGE]]).requires_grad_()
    adv = t([[1.0, -1.0, -1.0, 2.0, GARBAGE]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return log_probs, old, adv, mask


def test_ppo_clip_and_dual_clip_hand_example():
    log_probs, old, adv, mask = _ppo_example()
    loss, metrics = get_policy_loss("ppo")(
        log_probs, old, adv, mask, loss_agg_mode="token-mean", global_normalizer=4.0, clip_ratio_c=3.0
    )
    # token 0: A=1,  r=1.5: max(-1.5, -1.2) = -1.2            (clipped above)
    # token 1: A=-1, r=0.5: max(0.5, 0.8) = 0.8, min(0.8, 3) = 0.8   (clipped below)
    # token 2: A=-1, r=5:   max(5, 1.2) = 5, min(5, 3) = 3     (dual clip)
    # token 3: A=2,  r=1:   -2
    # token-mean: (-1.2 + 0.8 + 3 - 2) / 4 = 0.15
    assert loss.item() == pytest.approx(0.15, abs=1e-12)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)  # tokens 0 and 1
    assert metrics["clipfrac_lower"].item() == pytest.approx(0.25)  # token 2
    # approx_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + ln 5 + 0) / 4 = -ln(3.75) / 4 = -1.3217558 / 4
    assert metrics["approx_kl"].item() == pytest.approx(-0.33043896, abs=1e-8)
    loss.backward()
    # only token 3 is unclipped: d(-A r)/d log_prob = -A r = -2, divided by 4 tokens; padding gets 0
    torch.testing.assert_close(log_probs.grad, t([[0.0, 0.0, 0.0, -0.5, 0.0]]), atol=1e-12, rtol=0)


def test_ppo_decoupled_clip_range_hand_example():
    log_probs, old, adv, mask = _ppo_example()
    loss, _ = get_policy_loss("ppo")(
        log_probs, old, adv, mask, loss_agg_mode="token-mean", global_normalizer=4.0,
        clip_ratio_low=0.4, clip_ratio_high=0.28,
    )  # fmt: skip
    # token 0: -min(1.5, 1.28) = -1.28; token 1: max(0.5, 0.6) = 0.6; tokens 2, 3 as before: 3, -2
    # (-1.28 + 0.6 + 3 - 2) / 4 = 0.08
    assert loss.item() == pytest.approx(0.08, abs=1e-12)


def test_gspo_hand_example_and_sequence_level_gradient():
    # row 0: log-ratios 0.2, 0 -> s = exp(0.1) = 1.1051709 (inside [0.8, 1.2]); row 1: 0.5, 0.5 -> s = e^0.5,
    # clipped at 1.2. Third token of each row is padding.
    old = t([[0.0, 0.0, GARBAGE], [0.0, 0.0, GARBAGE]])
    log_probs = t([[0.2, 0.0, GARBAGE], [0.5, 0.5, -GARBAGE]]).requires_grad_()
    adv = t([[1.0, 1.0, GARBAGE], [1.0, 1.0, GARBAGE]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss, metrics = get_policy_loss("gspo")(
        log_probs, old, adv, mask, loss_agg_mode="seq-mean-token-mean", global_normalizer=2.0,
        clip_ratio_low=0.2, clip_ratio_high=0.2,
    )  # fmt: skip
    # (-1.1051709 + -1.2) / 2 sequences = -1.1525855
    assert loss.item() == pytest.approx(-1.15258545, abs=1e-8)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)  # both tokens of row 1
    loss.backward()
    # sequence-level GSPO: d(-A s)/d log_prob_t = -A s / |y| = -1.1051709 / 2, then / 2 sequences = -0.2762927
    torch.testing.assert_close(
        log_probs.grad, t([[-0.27629273, -0.27629273, 0.0], [0.0, 0.0, 0.0]]), atol=1e-8, rtol=0
    )


def test_truncated_importance_sampling_hand_example():
    log_probs = t([[0.0, 0.0, GARBAGE]]).requires_grad_()
    old = t([[0.0, 0.0, GARBAGE]])
    rollout = t([[-math.log(3.0), math.log(2.0), -GARBAGE]]).requires_grad_()  # old - rollout = ln 3, ln 0.5
    adv = t([[1.0, 1.0, GARBAGE]])
    mask = torch.tensor([[1, 1, 0]])
    for name in policy_loss_names():
        log_probs.grad = None
        loss, metrics = get_policy_loss(name)(
            log_probs, old, adv, mask, loss_agg_mode="token-mean", global_normalizer=2.0,
            rollout_log_probs_bt=rollout, tis_cap=2.0,
        )  # fmt: skip
        # weights min(3, 2) = 2 and min(0.5, 2) = 0.5; ratio 1 -> losses -2, -0.5; token-mean -1.25
        assert loss.item() == pytest.approx(-1.25, abs=1e-12), name
        assert metrics["tis_weight_mean"].item() == pytest.approx(1.25), name
        loss.backward()
        torch.testing.assert_close(log_probs.grad, t([[-1.0, -0.25, 0.0]]), atol=1e-12, rtol=0)
        assert rollout.grad is None  # the weight is detached


def test_masked_importance_sampling_drops_tokens_above_the_cap():
    """tis_mode=mask: weight w = exp(old - rollout) where w <= cap, 0 above it (the TIS example above)."""
    log_probs = t([[0.0, 0.0, GARBAGE]]).requires_grad_()
    old = t([[0.0, 0.0, GARBAGE]])
    rollout = t([[-math.log(3.0), math.log(2.0), -GARBAGE]])  # w = 3 (above the cap 2), 0.5
    adv = t([[1.0, 1.0, GARBAGE]])
    mask = torch.tensor([[1, 1, 0]])
    for name in policy_loss_names():
        log_probs.grad = None
        loss, metrics = get_policy_loss(name)(
            log_probs, old, adv, mask, loss_agg_mode="token-mean", global_normalizer=2.0,
            rollout_log_probs_bt=rollout, tis_cap=2.0, tis_mode="mask",
        )  # fmt: skip
        # weights 0 (masked) and 0.5; ratio 1 -> losses 0, -0.5; token-mean -0.25
        assert loss.item() == pytest.approx(-0.25, abs=1e-12), name
        assert metrics["tis_weight_mean"].item() == pytest.approx(0.25), name
        loss.backward()
        torch.testing.assert_close(log_probs.grad, t([[0.0, -0.25, 0.0]]), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="tis_mode='clip' is not one of"):
        get_policy_loss("ppo")(
            log_probs, old, adv, mask, loss_agg_mode="token-mean", global_normalizer=2.0,
            rollout_log_probs_bt=rollout, tis_cap=2.0, tis_mode="clip",
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# invariants


def _random_batch(seed=0, batch=8, resp_len=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 0, 5, 1, 6, 2, 4])[:batch]  # includes an all-padding row
    mask = (torch.arange(resp_len) < lengths.unsqueeze(-1)).long()
    old = -torch.rand(batch, resp_len, generator=g, dtype=F64) * 3
    log_probs = old + 0.3 * torch.randn(batch, resp_len, generator=g, dtype=F64)
    rollout = old + 0.2 * torch.randn(batch, resp_len, generator=g, dtype=F64)
    adv = torch.randn(batch, resp_len, generator=g, dtype=F64)
    return log_probs, old, rollout, adv, mask


@pytest.mark.parametrize("name", policy_loss_names())
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_shard_losses_add_up_to_full_batch_loss(name, mode):
    log_probs, old, rollout, adv, mask = _random_batch()
    kwargs = dict(clip_ratio_low=0.1, clip_ratio_high=0.15, tis_cap=1.5, loss_agg_mode=mode)
    normalizer = loss_normalizer(mask, mode, max_len=16)
    policy_loss = get_policy_loss(name)

    def total_loss_and_grad(num_shards):
        lp = log_probs.clone().requires_grad_()
        total = 0.0
        for idx in torch.arange(8).chunk(num_shards):
            loss, _ = policy_loss(
                lp[idx], old[idx], adv[idx], mask[idx], rollout_log_probs_bt=rollout[idx],
                global_normalizer=normalizer, **kwargs,
            )  # fmt: skip
            loss.backward()  # like micro-batches accumulating gradients
            total = total + loss.detach()
        return total, lp.grad

    full_loss, full_grad = total_loss_and_grad(1)
    for num_shards in (2, 4):
        loss, grad = total_loss_and_grad(num_shards)
        torch.testing.assert_close(loss, full_loss, atol=1e-12, rtol=0)
        torch.testing.assert_close(grad, full_grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_shards_add_up(mode):
    _, values, returns, old_values, mask = _random_batch(seed=1)
    normalizer = loss_normalizer(mask, mode, max_len=16)
    full, _ = value_loss(values, old_values, returns, mask, loss_agg_mode=mode, global_normalizer=normalizer)
    parts = sum(
        value_loss(
            values[i], old_values[i], returns[i], mask[i], loss_agg_mode=mode, global_normalizer=normalizer
        )[0]
        for i in torch.arange(8).chunk(4)
    )
    torch.testing.assert_close(parts, full, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", policy_loss_names())
def test_clipping_inactive_at_ratio_one_gradient_is_minus_advantage(name):
    _, old, _, adv, mask = _random_batch(seed=2)
    log_probs = old.clone().requires_grad_()
    loss, metrics = get_policy_loss(name)(
        log_probs,
        old,
        adv,
        mask,
        loss_agg_mode="token-mean",
        global_normalizer=loss_normalizer(mask, "token-mean"),
    )
    loss.backward()
    num_tokens = mask.sum().item()
    torch.testing.assert_close(log_probs.grad * num_tokens, -adv * mask, atol=1e-12, rtol=0)
    assert metrics["clipfrac"].item() == 0 and metrics["clipfrac_lower"].item() == 0
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / num_tokens, abs=1e-12)


@pytest.mark.parametrize("name", policy_loss_names())
def test_policy_loss_ignores_padding_garbage(name):
    log_probs, old, rollout, adv, mask = _random_batch(seed=3)
    pad = ~mask.bool()

    def run(dirty):
        lp = torch.where(pad, t(-GARBAGE), log_probs) if dirty else log_probs.clone()
        lp.requires_grad_()
        o = torch.where(pad, t(GARBAGE), old) if dirty else old
        r = torch.where(pad, t(-GARBAGE), rollout) if dirty else rollout
        a = torch.where(pad, t(GARBAGE), adv) if dirty else adv
        loss, metrics = get_policy_loss(name)(
            lp, o, a, mask, loss_agg_mode="seq-mean-token-mean", global_normalizer=7.0,
            rollout_log_probs_bt=r, tis_cap=2.0,
        )  # fmt: skip
        loss.backward()
        return loss, metrics, lp.grad

    clean, dirty = run(False), run(True)
    torch.testing.assert_close(dirty[0], clean[0], atol=0, rtol=0)
    for key in clean[1]:
        torch.testing.assert_close(dirty[1][key], clean[1][key], atol=0, rtol=0)
    torch.testing.assert_close(dirty[2], clean[2], atol=0, rtol=0)
    assert (dirty[2][pad] == 0).all()


# ---------------------------------------------------------------------------------------------------------
# value loss and entropy


def test_value_loss_hand_example():
    values = t([[1.0, 2.0, GARBAGE]]).requires_grad_()
    old_values, returns = t([[0.5, 2.0, -GARBAGE]]), t([[2.0, 1.0, GARBAGE]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = value_loss(
        values, old_values, returns, mask, loss_agg_mode="token-mean", global_normalizer=2.0
    )
    # token 0: clipped v = 0.5 + clip(0.5, +-0.2) = 0.7; max((1-2)^2, (0.7-2)^2) = 1.69 (clipped wins)
    # token 1: v - old = 0, so both terms (2-1)^2 = 1
    # 0.5 * (1.69 + 1) / 2 = 0.6725
    assert loss.item() == pytest.approx(0.6725, abs=1e-12)
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # token 0 is clipped (no gradient); token 1: 0.5 * 2 (v - R) / 2 = 0.5
    torch.testing.assert_close(values.grad, t([[0.0, 0.5, 0.0]]), atol=1e-12, rtol=0)
    unclipped, _ = value_loss(
        values, old_values, returns, mask, loss_agg_mode="token-mean", global_normalizer=2.0, value_clip=0.0
    )
    assert unclipped.item() == pytest.approx(0.5, abs=1e-12)  # 0.5 * (1 + 1) / 2


def test_entropy_hand_example():
    # uniform over 4: ln 4 = 1.3862944; p = (1/4, 3/4): 0.25 ln 4 + 0.75 ln(4/3) = 0.5623351
    assert entropy_from_logits(t([0.0, 0.0, 0.0, 0.0])).item() == pytest.approx(1.3862944, abs=1e-7)
    assert entropy_from_logits(t([[[0.0, math.log(3.0)]]])).item() == pytest.approx(0.5623351, abs=1e-7)


def test_entropy_chunking_changes_nothing_including_gradients():
    logits = torch.randn(3, 5, 11, dtype=F64)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    whole, chunked = entropy_from_logits(a, chunk_size=10_000), entropy_from_logits(b, chunk_size=4)
    torch.testing.assert_close(chunked, whole, atol=1e-12, rtol=0)
    (whole * torch.arange(5)).sum().backward()
    (chunked * torch.arange(5)).sum().backward()
    torch.testing.assert_close(b.grad, a.grad, atol=1e-12, rtol=0)
    assert entropy_from_logits(logits.to(torch.bfloat16)).dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------
# bad input


def _kwargs(**override):
    log_probs, old, rollout, adv, mask = _random_batch()
    kwargs = dict(
        log_probs_bt=log_probs, old_log_probs_bt=old, advantages_bt=adv, mask_bt=mask,
        loss_agg_mode="token-mean", global_normalizer=10.0,
    )  # fmt: skip
    kwargs.update(override)
    return kwargs


def test_unknown_names():
    with pytest.raises(ValueError, match=r"policy_loss='cispo'.*gspo, ppo"):
        get_policy_loss("cispo")
    with pytest.raises(ValueError, match=r"loss_agg_mode='mean'.*token-mean"):
        get_policy_loss("ppo")(**_kwargs(loss_agg_mode="mean"))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        loss_normalizer(torch.ones(2, 2), "sum")


@pytest.mark.parametrize("name", ["ppo", "gspo"])
@pytest.mark.parametrize(
    ("override", "arg"),
    [
        ({"advantages_bt": torch.zeros(8, 6, dtype=F64)}, "advantages_bt"),
        ({"old_log_probs_bt": torch.zeros(7, 7, dtype=F64)}, "old_log_probs_bt"),
        ({"mask_bt": torch.ones(8)}, "mask_bt"),
        ({"tis_cap": 2.0}, "rollout_log_probs_bt"),
        ({"tis_cap": 2.0, "rollout_log_probs_bt": torch.zeros(8, dtype=F64)}, "rollout_log_probs_bt"),
        ({"global_normalizer": 0.0}, "global_normalizer"),
        ({"clip_ratio_low": 1.5}, "clip_ratio_low"),
    ],
)
def test_bad_input_names_the_argument(name, override, arg):
    with pytest.raises(ValueError, match=arg):
        get_policy_loss(name)(**_kwargs(**override))


def test_bad_value_and_normalizer_input():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("ppo")(**_kwargs(clip_ratio_c=1.0))
    with pytest.raises(ValueError, match="max_len"):
        loss_normalizer(torch.ones(2, 3), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="returns_bt"):
        value_loss(
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.zeros(2, 4),
            torch.ones(2, 3),
            loss_agg_mode="token-mean",
            global_normalizer=1.0,
        )
    with pytest.raises(ValueError, match="loss_mat_bt"):
        agg_loss(torch.zeros(3, 3), torch.ones(2, 3), "token-mean", 1.0)
