"""The per-micro-batch functions the trainer hands to `MegatronRole.run`: log-probs only (old/ref
forward), the actor's policy loss (+ KL loss, entropy bonus), the critic's values and value loss, built
from algorithms/.

Each returns metric SUMS weighted by valid tokens plus `tokens`, so the trainer can average exactly over
micro-batches and DP ranks. Metrics named `*loss` are instead the micro-batch's share of a mini-batch loss
term (summed over micro-batches and DP, not averaged; engine/step/update.py reports their mean per optimizer
step). The actor's terms, as verl logs them, aggregated like the loss (`algorithm.loss_agg_mode`):
    loss = pg_loss - entropy_coef * entropy_loss + kl_loss_coef * kl_loss
`pg_loss` the policy-gradient term alone, `entropy_loss` the aggregated entropy, `kl_loss` the aggregated KL to
the reference (0 without a KL loss); `loss` the total that is back-propagated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algorithms.kl import get_kl_estimator, kl_estimator_is_token_local
from algorithms.losses import agg_loss, get_policy_loss, policy_loss_traits, value_loss
from engine.config import AlgorithmConfig
from engine.models.compiled import LOGPROBS, cuda_kernel
from engine.roles.policy import ResponseStats

# names ending in "loss": shares of a mini-batch loss term (summed over micro-batches); the others: sums
# weighted by valid tokens
ACTOR_METRICS = (
    "loss",
    "pg_loss",
    "entropy_loss",
    "kl_loss",
    "pg_clipfrac",
    "pg_clipfrac_lower",
    "ppo_kl",
    "entropy",
    "rollout_kl",
)
CRITIC_METRICS = ("vf_loss", "vf_clipfrac", "vpred_mean")
# means over the first mini-batch only (run_updates' first_only): the rollout-vs-training gap before any update
ACTOR_FIRST_MINI_BATCH_METRICS = ("rollout_kl",)


def actor_metric_names(rollout_log_probs: bool, tis: bool = False) -> tuple[str, ...]:
    """ACTOR_METRICS, less rollout_kl when the step has no rollout log-probs (rollout.log_probs=false), plus
    tis_weight (the mean importance weight) with algorithm.tis_cap > 0."""
    names = ACTOR_METRICS if rollout_log_probs else tuple(n for n in ACTOR_METRICS if n != "rollout_kl")
    return (*names, "tis_weight") if tis else names


def log_prob_fn(stats: ResponseStats, mb: dict):
    """Forward-only: log-probs of the response tokens."""
    logp = stats.log_probs
    return torch.zeros((), device=logp.device), {"log_probs": logp.detach()}


def make_actor_loss(alg: AlgorithmConfig, normalizer: float, kl_ref: bool, rollout_log_probs: bool = True):
    """Loss for one micro-batch of an actor mini-batch whose global normaliser is `normalizer`; its metrics are
    `actor_metric_names(rollout_log_probs)` (micro-batches carry `rollout_log_probs` exactly when it is true)."""
    policy_loss = get_policy_loss(alg.policy_loss)
    kl_on = kl_ref and alg.kl_loss_coef > 0
    kl_fn = get_kl_estimator(alg.kl_estimator) if kl_on else None
    kwargs = dict(_policy_kwargs(alg))

    def loss_fn(stats: ResponseStats, mb: dict):
        mask = mb["response_mask"]
        logp = stats.log_probs
        ent = stats.entropy  # its backward runs only when the entropy bonus uses it
        old = mb.get(
            "old_log_probs", logp.detach()
        )  # on-policy single pass: old == current, no extra forward
        pg_loss, m = policy_loss(
            logp,
            old,
            mb["advantages"],
            mask,
            loss_agg_mode=alg.loss_agg_mode,
            global_normalizer=normalizer,
            rollout_log_probs_bt=mb.get("rollout_log_probs") if alg.tis_cap > 0 else None,
            **kwargs,
        )
        loss = pg_loss
        entropy_loss = agg_loss(
            ent if alg.entropy_coef > 0 else ent.detach(), mask, alg.loss_agg_mode, normalizer
        )
        if alg.entropy_coef > 0:
            loss = loss - alg.entropy_coef * entropy_loss
        kl_loss = torch.zeros((), device=logp.device)
        if kl_fn is not None:
            kl = kl_fn(logp, mb["ref_log_probs"], mask)
            kl_loss = agg_loss(kl, mask, alg.loss_agg_mode, normalizer)
            loss = loss + alg.kl_loss_coef * kl_loss
        tokens = mask.sum()
        metrics = {
            "loss": loss.detach(),
            "pg_loss": pg_loss.detach(),
            "entropy_loss": entropy_loss.detach(),
            "kl_loss": kl_loss.detach(),
            "pg_clipfrac": m["clipfrac"] * tokens,
            "pg_clipfrac_lower": m.get("clipfrac_lower", torch.zeros(())) * tokens,
            "ppo_kl": m["approx_kl"] * tokens,
            "entropy": (ent.detach() * mask).sum(),
            "tokens": tokens,
        }
        if rollout_log_probs:  # k1 KL(rollout || training forward)
            metrics["rollout_kl"] = ((mb["rollout_log_probs"] - logp.detach()) * mask).sum()
        if alg.tis_cap > 0:
            metrics["tis_weight"] = m["tis_weight_mean"] * tokens
        return loss, metrics

    token_local = policy_loss_traits(alg.policy_loss).token_local and (
        not kl_on or kl_estimator_is_token_local(alg.kl_estimator)
    )
    loss_fn.token_grads = _token_grads(alg, normalizer, kl_on) if token_local else None
    return loss_fn


def _policy_kwargs(alg: AlgorithmConfig) -> tuple[tuple[str, object], ...]:
    """The policy loss's settings from `alg` (clip ranges, the dual clip where the loss takes one, importance
    weights), as (name, value) pairs: hashable, for `_TokenLoss`."""
    dual = (("clip_ratio_c", alg.clip_ratio_c),) if policy_loss_traits(alg.policy_loss).dual_clip else ()
    return (
        ("clip_ratio_low", alg.clip_ratio_low),
        ("clip_ratio_high", alg.clip_ratio_high),
        ("tis_cap", alg.tis_cap),
        ("tis_mode", alg.tis_mode),
        *dual,
    )


@dataclass(frozen=True)
class _TokenLoss:
    """The actor loss's per-token terms (a token-local policy loss, its KL term), as one pure function of a
    chunk's log-probs: `logp_grad`, compiled into one kernel on CUDA (`_logp_grad_fn`)."""

    policy_loss: str
    kwargs: tuple[tuple[str, object], ...]
    """`_policy_kwargs`."""
    kl_estimator: str | None
    kl_loss_coef: float

    def logp_grad(self, logp, old, adv, mask, weight, ref, rollout) -> torch.Tensor:
        """weight_t * d(l_t)/d(logp_t) for 1-D per-token inputs, l_t the token's policy loss (+ kl_loss_coef x
        its KL): the gradient of their sum (the registered functions `loss_fn` calls, on a (n, 1) batch)."""

        def col(x):
            return None if x is None else x[:, None]

        def total(x):
            loss, _ = get_policy_loss(self.policy_loss)(
                x[:, None],
                col(old),
                col(adv),
                col(mask),
                loss_agg_mode="seq-mean-token-sum",  # with normaliser 1: the sum of the token losses
                global_normalizer=1.0,
                rollout_log_probs_bt=col(rollout),
                **dict(self.kwargs),
            )
            if self.kl_estimator is not None:
                kl = get_kl_estimator(self.kl_estimator)(x[:, None], col(ref), col(mask))
                loss = loss + self.kl_loss_coef * torch.where(col(mask), kl, 0.0).sum()
            return loss

        return torch.func.grad(total)(logp) * weight


def _logp_grad_fn(loss: _TokenLoss, device: torch.device):
    """`loss.logp_grad` compiled (one graph per setting, symbolic in the chunk size) on CUDA; eager on CPU and with
    ENGINE_COMPILE_LOGPROBS=0. On the host the eager function costs ~70 ops per chunk, which at 0.5B
    outweighs the GEMM the one-pass head saves."""
    return cuda_kernel(loss.logp_grad, device, LOGPROBS, key=loss)


def _token_grads(alg: AlgorithmConfig, normalizer: float, kl: bool):
    """`token_grads(mb, valid)`: the actor loss's gradient per token over the head's tokens (mb's
    `response_valid`, or every (row, step) entry when None), as engine/models/fused_logprobs.py's `TokenGrads`.
    Only for token-local losses: there dL/dlogp_t = w_t * d(l_t)/dlogp_t, with l_t the token's policy loss
    (+ kl_loss_coef x its KL) and w_t its weight in the aggregation (`agg_loss` is linear in the per-token
    losses: its gradient at any point); dL/dent_t = -entropy_coef * w_t (with an entropy bonus). `kl`: the
    loss has a KL term."""
    loss = _TokenLoss(
        policy_loss=alg.policy_loss,
        kwargs=_policy_kwargs(alg),
        kl_estimator=alg.kl_estimator if kl else None,
        kl_loss_coef=alg.kl_loss_coef if kl else 0.0,
    )
    ent_coef = alg.entropy_coef if alg.entropy_coef > 0 else 0.0

    def token_grads(mb: dict, valid: torch.Tensor | None):
        def flat(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            x = x.reshape(-1)
            return x if valid is None else x[valid]

        mask_bt = mb["response_mask"]
        with torch.enable_grad():
            probe = torch.zeros(
                mask_bt.shape, dtype=mb["advantages"].dtype, device=mask_bt.device, requires_grad=True
            )
            (w_bt,) = torch.autograd.grad(agg_loss(probe, mask_bt, alg.loss_agg_mode, normalizer), probe)
        weight, mask, adv, old = (
            flat(w_bt),
            flat(mask_bt.bool()),
            flat(mb["advantages"]),
            flat(mb.get("old_log_probs")),
        )
        ref = flat(mb["ref_log_probs"]) if kl else None
        rollout = flat(mb["rollout_log_probs"]) if alg.tis_cap > 0 else None
        logp_grad = _logp_grad_fn(loss, mask_bt.device)

        def grads(rows: slice, logp: torch.Tensor, ent: torch.Tensor):
            def at(x):
                return None if x is None else x[rows]

            # on-policy single pass (no old log-probs): old == current, as loss_fn (not differentiated)
            g = logp_grad(
                logp,
                logp if old is None else old[rows],
                adv[rows],
                mask[rows],
                weight[rows],
                at(ref),
                at(rollout),
            )
            return g, -ent_coef * weight[rows]

        return grads

    return token_grads


def response_values(values_local: torch.Tensor, mb: dict) -> torch.Tensor:
    """(b, T) value of the state before each response token: the critic output (b, s, 1) at position
    prompt_len + j - 1, the same position whose logits give token j's log-prob."""
    return values_local[..., 0].gather(1, mb["response_index"])


def value_fn(values_local: torch.Tensor, mb: dict):
    """Forward-only: the critic's values of the response tokens."""
    values = response_values(values_local, mb)
    return torch.zeros((), device=values.device), {"values": values.detach()}


def make_critic_loss(alg: AlgorithmConfig, normalizer: float):
    """Clipped value loss for one micro-batch of a critic mini-batch whose global normaliser is `normalizer`."""

    def loss_fn(values_local: torch.Tensor, mb: dict):
        mask = mb["response_mask"]
        loss, m = value_loss(
            response_values(values_local, mb),
            mb["values"],
            mb["returns"],
            mask,
            loss_agg_mode=alg.loss_agg_mode,
            global_normalizer=normalizer,
            value_clip=alg.value_clip,
        )
        tokens = mask.sum()
        metrics = {
            "vf_loss": loss.detach(),
            "vf_clipfrac": m["vf_clipfrac"] * tokens,
            "vpred_mean": m["vpred_mean"] * tokens,
            "tokens": tokens,
        }
        return loss, metrics

    return loss_fn
