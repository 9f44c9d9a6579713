"""KL between the actor and the reference policy: per-token estimators, KL in the reward, controllers.

Estimators (Schulman, "Approximating KL divergence", 2020), of KL(actor || ref) from samples of the actor,
with d = log_probs - ref_log_probs per token:
    k1   d                              unbiased, high variance, can be negative
    abs  |d|
    k2   d^2 / 2                        (verl's "mse")
    k3   exp(-d) - 1 + d, clamped to [-10, 10]   (verl's "low_var_kl"; d clamped to [-20, 20] first)
All take (log_probs_bt, ref_log_probs_bt, mask_bt) and return kl_bt (batch, resp_len), zero on padding.

KL as a loss term is an estimator plus `losses.agg_loss`:
    kl_loss = agg_loss(get_kl_estimator(name)(log_probs_bt, ref_bt, mask_bt), mask_bt, mode, normalizer)
KL in the reward: token_rewards_bt = scores_to_token_rewards(scores_b, mask_bt, kl_bt=..., kl_coef=ctrl.value),
with `ctrl` a FixedKLController or AdaptiveKLController (Ziegler et al. 2019) updated once per step.
Nothing here knows about configs or torch.distributed.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from algorithms._common import Registry, check_like_mask, check_mask, check_per_sequence

KLEstimator = Callable[[Tensor, Tensor, Tensor], Tensor]
_KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", "kl_estimator")


_TOKEN_LOCAL: set[str] = set()


def register_kl_estimator(name: str, token_local: bool = False) -> Callable[[KLEstimator], KLEstimator]:
    """Decorator: register `fn(log_probs_bt, ref_log_probs_bt, mask_bt) -> kl_bt` under `name`. `token_local`:
    each token's KL depends on that token's log-probs only (see losses.PolicyLossTraits.token_local)."""
    register = _KL_ESTIMATORS.register(name)

    def decorator(fn: KLEstimator) -> KLEstimator:
        fn = register(fn)
        if token_local:
            _TOKEN_LOCAL.add(name)
        return fn

    return decorator


def kl_estimator_is_token_local(name: str) -> bool:
    """Whether the KL estimator `name` was registered token-local; ValueError listing the known names otherwise."""
    _KL_ESTIMATORS.get(name)
    return name in _TOKEN_LOCAL


def get_kl_estimator(name: str) -> KLEstimator:
    """The KL estimator registered as `name`; ValueError listing the known names otherwise."""
    return _KL_ESTIMATORS.get(name)


def kl_estimator_names() -> list[str]:
    return _KL_ESTIMATORS.names()


def _log_ratio(log_probs_bt: Tensor, ref_log_probs_bt: Tensor, mask_bt: Tensor) -> tuple[Tensor, Tensor]:
    """Checked bool mask and d = log_probs - ref_log_probs with padding set to 0 (garbage cannot leak)."""
    mask_bt = check_mask(mask_bt)
    log_probs_bt = check_like_mask(log_probs_bt, "log_probs_bt", mask_bt)
    ref_log_probs_bt = check_like_mask(ref_log_probs_bt, "ref_log_probs_bt", mask_bt)
    zero = torch.zeros((), dtype=log_probs_bt.dtype, device=log_probs_bt.device)
    return mask_bt, torch.where(mask_bt, log_probs_bt - torch.where(mask_bt, ref_log_probs_bt, zero), zero)


@register_kl_estimator("k1", token_local=True)
def kl_k1(log_probs_bt: Tensor, ref_log_probs_bt: Tensor, mask_bt: Tensor) -> Tensor:
    _, d_bt = _log_ratio(log_probs_bt, ref_log_probs_bt, mask_bt)
    return d_bt


@register_kl_estimator("abs", token_local=True)
def kl_abs(log_probs_bt: Tensor, ref_log_probs_bt: Tensor, mask_bt: Tensor) -> Tensor:
    _, d_bt = _log_ratio(log_probs_bt, ref_log_probs_bt, mask_bt)
    return d_bt.abs()


@register_kl_estimator("k2", token_local=True)
def kl_k2(log_probs_bt: Tensor, ref_log_probs_bt: Tensor, mask_bt: Tensor) -> Tensor:
    _, d_bt = _log_ratio(log_probs_bt, ref_log_probs_bt, mask_bt)
    return 0.5 * d_bt.square()


@register_kl_estimator("k3", token_local=True)
def kl_k3(log_probs_bt: Tensor, ref_log_probs_bt: Tensor, mask_bt: Tensor) -> Tensor:
    mask_bt, d_bt = _log_ratio(log_probs_bt, ref_log_probs_bt, mask_bt)
    ref_minus_actor_bt = (-d_bt).clamp(-20.0, 20.0)
    kl_bt = (ref_minus_actor_bt.exp() - ref_minus_actor_bt - 1).clamp(-10.0, 10.0)
    return torch.where(mask_bt, kl_bt, torch.zeros((), dtype=kl_bt.dtype, device=kl_bt.device))


@torch.no_grad()
def scores_to_token_rewards(
    scores_b: Tensor, mask_bt: Tensor, *, kl_bt: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Token rewards (batch, resp_len): the score on the last valid token, minus kl_coef * kl_bt on every
    valid token; zero on padding. A row with no valid token gets no reward."""
    mask_bt = check_mask(mask_bt)
    scores_b = check_per_sequence(scores_b, "scores_b", mask_bt)
    zero = torch.zeros((), dtype=scores_b.dtype, device=scores_b.device)
    if mask_bt.shape[1] == 0:
        return torch.zeros(mask_bt.shape, dtype=scores_b.dtype, device=scores_b.device)
    positions_t = torch.arange(mask_bt.shape[1], device=mask_bt.device)
    last_b = torch.where(mask_bt, positions_t, -1).amax(-1, keepdim=True)  # (batch, 1); -1 if no valid token
    rewards_bt = torch.where(positions_t == last_b, scores_b.unsqueeze(-1), zero)  # (batch, resp_len)
    if kl_bt is not None and kl_coef != 0:
        kl_bt = torch.where(mask_bt, check_like_mask(kl_bt, "kl_bt", mask_bt), zero)
        rewards_bt = rewards_bt - kl_coef * kl_bt
    return torch.where(mask_bt, rewards_bt, zero)


class FixedKLController:
    """Constant KL-in-reward coefficient `value`: the configured one, also after a resume (a checkpoint's
    coefficient never replaces it: a run resumed with another kl_reward_coef uses its own)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; same interface as AdaptiveKLController."""

    def state_dict(self) -> dict[str, float | str]:
        return {"kind": "fixed", "value": self.value, "kl_coef": self.value}

    def load_state_dict(self, state: dict[str, float | str]) -> None:
        """Nothing to restore: the coefficient is the configuration's."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv 1909.08593, section 2.2).

    After each step: e = clip(current_kl / target - 1, -0.2, 0.2); value *= 1 + e * n_steps / horizon,
    where current_kl is the step's mean KL per sequence and n_steps the number of sequences (verl's rule).
    The coefficient is state: save `state_dict()` with checkpoints so resumed runs continue from it, unless
    the resumed run starts from another coefficient (kl_reward_coef changed, or the checkpoint's controller
    was fixed): then it starts from its own, as the resume log's "this run uses its own values" says.
    """

    def __init__(self, kl_coef: float, target: float, horizon: int):
        if not target > 0 or not horizon > 0:
            raise ValueError(f"kl_target={target!r} and kl_horizon={horizon!r} must both be > 0")
        self.initial = float(kl_coef)
        self.value = float(kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float | str]:
        return {"kind": "adaptive", "value": self.value, "kl_coef": self.initial}

    def load_state_dict(self, state: dict[str, float | str]) -> None:
        same_start = float(state.get("kl_coef", self.initial)) == self.initial  # (older checkpoints: no key)
        if state.get("kind", "adaptive") == "adaptive" and same_start:
            self.value = float(state["value"])


KL_CONTROLLERS = ("fixed", "adaptive")
KL_CONTROLLERS_WITH_TARGET = ("adaptive",)
"""The controllers that read `target` and `horizon`."""


def make_kl_controller(
    kind: str, *, kl_coef: float, target: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """`fixed` or `adaptive` controller starting at kl_coef; target and horizon are for `adaptive` only."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target, horizon)
    raise ValueError(
        f"kl_ctrl={kind!r} is not a known KL controller; known names: {', '.join(KL_CONTROLLERS)}"
    )
