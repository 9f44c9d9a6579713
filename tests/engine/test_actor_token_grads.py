"""engine/step/losses.py `make_actor_loss`'s `token_grads` (what the one-pass output head takes, engine/models/
fused_logprobs.py `linear_log_probs_one_pass`) against autograd through the actor loss itself: for every
token-local loss setting (each aggregation mode, dual clip, clip-higher, truncated and masked importance
weights, each KL estimator as a loss, the entropy bonus, on-policy without old log-probs), the per-token
gradients of log-probs and entropies, over the valid tokens (`response_valid`) or every (row, step) entry,
taken chunk by chunk, equal d loss / d logp and d loss / d entropy (float64, 1e-12). Losses that are not
token-local (GSPO, a registered loss or KL estimator that does not say it is) get no `token_grads`."""

from dataclasses import replace

import pytest
import torch

from algorithms.kl import get_kl_estimator, register_kl_estimator
from algorithms.losses import LOSS_AGG_MODES, get_policy_loss, loss_normalizer, register_policy_loss
from engine.config import AlgorithmConfig
from engine.roles.policy import ResponseStats
from engine.step.losses import make_actor_loss

B, T = 5, 7


def micro_batch(seed: int, old: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 1, 6, 4])
    mask = torch.arange(T) < lengths[:, None]
    mb = {
        "response_mask": mask,
        "advantages": torch.randn(B, T, generator=g, dtype=torch.float64) * mask,
        "rollout_log_probs": -torch.rand(B, T, generator=g, dtype=torch.float64) * mask,
        "ref_log_probs": -torch.rand(B, T, generator=g, dtype=torch.float64) * mask,
        "response_valid": mask.reshape(-1).nonzero()[:, 0],
    }
    if old:  # spread so that some ratios clip (log ratios in (-2, 2)) and the dual clip bites
        mb["old_log_probs"] = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 * mask
    return mb


def stats(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return logp.requires_grad_(), (torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()


SETTINGS = [
    dict(loss_agg_mode=mode, entropy_coef=0.01, kl_loss_coef=0.1, kl_estimator=kl)
    for mode, kl in zip(LOSS_AGG_MODES, ("k3", "k1", "k2", "abs"))
] + [
    dict(clip_ratio_high=0.28, clip_ratio_c=1.5, tis_cap=1.2, tis_mode="truncate"),
    dict(tis_cap=1.2, tis_mode="mask", loss_agg_mode="seq-mean-token-mean", kl_loss_coef=0.5),
]


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
@pytest.mark.parametrize("valid", [True, False])
@pytest.mark.parametrize("old", [True, False])
def test_token_grads_equal_autograd_through_the_loss(setting, valid, old):
    alg = replace(AlgorithmConfig(), **SETTINGS[setting])
    mb = micro_batch(setting, old)
    norm = loss_normalizer(mb["response_mask"], alg.loss_agg_mode, max_len=T)
    loss_fn = make_actor_loss(alg, norm, kl_ref=True)
    logp, ent = stats(10 + setting)
    loss, _ = loss_fn(ResponseStats(logp, ent), mb)
    want_logp, want_ent = torch.autograd.grad(loss, (logp, ent), allow_unused=True, materialize_grads=True)
    index = mb["response_valid"] if valid else None
    grads = loss_fn.token_grads(mb, index)
    flat_logp = logp.detach().reshape(-1) if index is None else logp.detach().reshape(-1)[index]
    flat_ent = ent.detach().reshape(-1) if index is None else ent.detach().reshape(-1)[index]
    parts = [
        grads(rows, flat_logp[rows], flat_ent[rows]) for rows in (slice(0, 4), slice(4, 9), slice(9, None))
    ]
    got_logp, got_ent = (torch.cat([p[i] for p in parts]) for i in (0, 1))
    want_logp, want_ent = (
        x.reshape(-1) if index is None else x.reshape(-1)[index] for x in (want_logp, want_ent)
    )
    assert want_logp.abs().max() > 0
    torch.testing.assert_close(got_logp, want_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_ent, want_ent.to(got_ent.dtype), rtol=0, atol=1e-12)


def test_clipping_is_active_in_the_settings():
    """The settings reach the clipped and dual-clipped branches (else the test above would not cover them)."""
    mb = micro_batch(4)
    loss = get_policy_loss("ppo")
    logp, _ = stats(14)
    _, m = loss(
        logp, mb["old_log_probs"], mb["advantages"], mb["response_mask"], loss_agg_mode="token-mean",
        global_normalizer=1.0, clip_ratio_high=0.28, clip_ratio_c=1.5,
    )  # fmt: skip
    assert m["clipfrac"] > 0 and m["clipfrac_lower"] > 0


def test_losses_that_are_not_token_local_get_none(monkeypatch):
    import algorithms.kl as kl
    import algorithms.losses as losses

    # the registrations below go into copies of the registries, put back after the test
    monkeypatch.setattr(losses._POLICY_LOSSES, "_fns", dict(losses._POLICY_LOSSES._fns))
    monkeypatch.setattr(losses, "_POLICY_LOSS_TRAITS", dict(losses._POLICY_LOSS_TRAITS))
    monkeypatch.setattr(kl._KL_ESTIMATORS, "_fns", dict(kl._KL_ESTIMATORS._fns))
    assert (
        make_actor_loss(replace(AlgorithmConfig(), policy_loss="gspo"), 1.0, kl_ref=False).token_grads is None
    )

    @register_policy_loss("test_batch_centred")
    def centred(log_probs_bt, old_log_probs_bt, advantages_bt, mask_bt, **kw):
        ppo = get_policy_loss("ppo")
        return ppo(log_probs_bt - log_probs_bt.mean(), old_log_probs_bt, advantages_bt, mask_bt, **kw)

    @register_kl_estimator("test_kl_batch_mean")
    def kl_mean(log_probs_bt, ref_bt, mask_bt):
        return get_kl_estimator("k1")(log_probs_bt, ref_bt, mask_bt).mean().expand_as(log_probs_bt)

    assert (
        make_actor_loss(replace(AlgorithmConfig(), policy_loss="test_batch_centred"), 1.0, False).token_grads
        is None
    )
    alg = replace(AlgorithmConfig(), kl_loss_coef=0.1, kl_estimator="test_kl_batch_mean")
    assert make_actor_loss(alg, 1.0, kl_ref=True).token_grads is None
    assert make_actor_loss(replace(alg, kl_loss_coef=0.0), 1.0, kl_ref=True).token_grads is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setting", [0, 4, 5])
def test_compiled_token_grads_on_gpu_equal_eager(setting, monkeypatch):
    """On CUDA the per-token gradient runs compiled (one kernel per setting, any chunk size): float32, equal
    to the eager function within 1e-6 of the largest, for chunks of two sizes (no recompile between them)."""
    alg = replace(AlgorithmConfig(), **SETTINGS[setting])
    mb = {k: v.cuda().float() if v.is_floating_point() else v.cuda() for k, v in micro_batch(setting).items()}
    norm = loss_normalizer(mb["response_mask"], alg.loss_agg_mode, max_len=T)
    logp, ent = (x.detach().cuda().float().reshape(-1) for x in stats(10 + setting))
    out = {}
    for compiled in ("1", "0"):
        monkeypatch.setenv("ENGINE_COMPILE_LOGPROBS", compiled)
        grads = make_actor_loss(alg, norm, kl_ref=True).token_grads(mb, None)
        out[compiled] = [
            torch.cat(x) for x in zip(*(grads(r, logp[r], ent[r]) for r in (slice(0, 20), slice(20, None))))
        ]
    for a, b in zip(out["1"], out["0"]):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max(), (a - b).abs().max()
