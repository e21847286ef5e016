"""KL estimators, KL in the reward with its controllers, and the KL loss term.

Per-token estimators of KL(π_θ ‖ π_ref) from samples y_t ~ π_θ (Schulman 2020, "Approximating KL
divergence"), with log r = log π_ref(y_t) − log π_θ(y_t):

========= ====================== =============================================================
name      estimate               properties
========= ====================== =============================================================
``kl``    k1 = −log r            unbiased, high variance, can be negative
``abs``   |log r|                ≥ 0, biased
``mse``   k2 = ½ (log r)²        ≥ 0, low variance, biased; ∇k2 is the gradient of KL
``low_var_kl`` k3 = r − 1 − log r unbiased, ≥ 0, low variance (clamped for stability, see below)
========= ====================== =============================================================

A ``+`` suffix (``kl+``, ``abs+``, ``mse+``, ``low_var_kl+``) keeps the forward value of the named
estimator but back-propagates k2's gradient (straight-through: ``k2 + sg(est − k2)``), since the
gradient of k1 or k3 is not an estimate of ∇KL while the gradient of k2 is.

KL enters training in one of two ways:

- in the reward (``algorithm.use_kl_in_reward``): :func:`apply_kl_penalty` gives r_t − β·KL_t, with β
  from a ``fixed`` or ``adaptive`` controller (:func:`make_kl_controller`);
- as a loss term (``actor.use_kl_loss``): :func:`compute_kl_loss` gives ``kl_loss_coef · agg(KL)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple, Protocol

import torch
from torch import Tensor

from verl_core.algorithms.aggregation import AggNorm, aggregate_loss
from verl_core.algorithms.stats import masked_mean
from verl_core.registry import Registry


class KLEstimator(Protocol):
    """Per-token KL estimate ``(B, T)`` from ``log_prob (B, T)`` (sampling policy) and ``ref_log_prob``."""

    def __call__(self, log_prob: Tensor, ref_log_prob: Tensor) -> Tensor: ...


KL_ESTIMATOR_REGISTRY: Registry[KLEstimator] = Registry("KL estimator")

KLEstimatorName = Literal["kl", "abs", "mse", "low_var_kl", "kl+", "abs+", "mse+", "low_var_kl+"]


def get_kl_estimator(name: str) -> KLEstimator:
    """The KL estimator registered as ``name`` (raises, listing valid names, if unknown)."""
    return KL_ESTIMATOR_REGISTRY.get(name)


@KL_ESTIMATOR_REGISTRY.register("kl")
def kl_k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k1 = log π_θ − log π_ref."""
    return log_prob - ref_log_prob


@KL_ESTIMATOR_REGISTRY.register("abs")
def kl_abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """|log π_θ − log π_ref|."""
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATOR_REGISTRY.register("mse")
def kl_k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k2 = ½ (log π_θ − log π_ref)²."""
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATOR_REGISTRY.register("low_var_kl")
def kl_k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k3 = r − 1 − log r with log r = clamp(log π_ref − log π_θ, ±20), result clamped to ±10 (as verl)."""
    log_r = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
    return torch.clamp(torch.exp(log_r) - log_r - 1.0, -10.0, 10.0)


def _straight_through(estimator: KLEstimator) -> KLEstimator:
    """``estimator``'s value with k2's gradient: k2 + sg(est − k2)."""

    def straight_through(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
        k2 = kl_k2(log_prob, ref_log_prob)
        return k2 + (estimator(log_prob, ref_log_prob) - k2).detach()

    return straight_through


for _name in ("kl", "abs", "mse", "low_var_kl"):
    KL_ESTIMATOR_REGISTRY.register(f"{_name}+")(_straight_through(KL_ESTIMATOR_REGISTRY.get(_name)))

KL_ESTIMATORS: tuple[str, ...] = KL_ESTIMATOR_REGISTRY.names()


# ---------------------------------------------------------------------------------------------------
# KL in the reward
# ---------------------------------------------------------------------------------------------------


class KLPenaltyStats(NamedTuple):
    """Metrics of :func:`apply_kl_penalty`.

    Attributes:
        kl: detached scalar, mean over sequences of the per-sequence token-mean KL (feed it to
            ``controller.update``; verl logs it as ``actor/reward_kl_penalty``).
        kl_coef: β used.
    """

    kl: Tensor
    kl_coef: float


class KLPenaltyOutput(NamedTuple):
    """Result of :func:`apply_kl_penalty`.

    Attributes:
        token_level_rewards: ``(B, T)`` r_t − β·KL_t.
        kl: ``(B, T)`` per-token KL estimate, 0 outside the mask.
        stats: :class:`KLPenaltyStats`.
    """

    token_level_rewards: Tensor
    kl: Tensor
    stats: KLPenaltyStats


@torch.no_grad()
def apply_kl_penalty(
    *,
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    kl_penalty: str,
) -> KLPenaltyOutput:
    """Subtract a per-token KL penalty from the rewards (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022).

    r_t = score_t − β · KL_t,  KL_t = estimator(log π_old(y_t), log π_ref(y_t))

    Args:
        token_level_scores: ``(B, T)`` task rewards per token (outcome score on the last token).
        old_log_prob: ``(B, T)`` log-probs of the sampling policy.
        ref_log_prob: ``(B, T)`` log-probs of the reference policy.
        response_mask: ``(B, T)``.
        kl_coef: β (``controller.value``).
        kl_penalty: one of :data:`KL_ESTIMATORS`.
    """
    mask = response_mask.to(token_level_scores.dtype)
    kl = get_kl_estimator(kl_penalty)(old_log_prob, ref_log_prob).to(mask.dtype) * mask  # (B, T)
    seq_kl = masked_mean(kl, mask, dim=-1)  # (B,)
    return KLPenaltyOutput(
        token_level_rewards=token_level_scores - kl_coef * kl,
        kl=kl,
        stats=KLPenaltyStats(kl=seq_kl.mean(), kl_coef=kl_coef),
    )


class KLController(Protocol):
    """State of the in-reward KL coefficient β; saved in checkpoints via state_dict()."""

    @property
    def value(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """β stays at its initial value."""

    def __init__(self, kl_coef: float) -> None:
        self._value = float(kl_coef)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: β is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self._value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._value = float(state["value"])


class AdaptiveKLController:
    """β tracks a target KL (Ziegler et al. 2019, §2.2).

    e = clip(KL / KL_target − 1, −0.2, 0.2);  β ← β · (1 + e · n_steps / horizon)

    Args:
        kl_coef: initial β.
        target_kl: KL_target.
        horizon: number of samples over which β may change by ≈ e^{±0.2}.
    """

    def __init__(self, kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl} and {horizon}")
        self._value = float(kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β towards the target given the measured KL over ``n_steps`` samples (the batch size)."""
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self._value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self._value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._value = float(state["value"])


KLControllerFactory = Callable[[float, float | None, float | None], KLController]
"""``(kl_coef, target_kl, horizon) -> KLController``."""

KL_CONTROLLER_REGISTRY: Registry[KLControllerFactory] = Registry("KL controller")

KLControllerName = Literal["fixed", "adaptive"]


@KL_CONTROLLER_REGISTRY.register("fixed")
def _make_fixed(kl_coef: float, target_kl: float | None, horizon: float | None) -> KLController:
    return FixedKLController(kl_coef)


@KL_CONTROLLER_REGISTRY.register("adaptive")
def _make_adaptive(kl_coef: float, target_kl: float | None, horizon: float | None) -> KLController:
    if target_kl is None or horizon is None:
        raise ValueError("the adaptive KL controller needs target_kl and horizon")
    return AdaptiveKLController(kl_coef, target_kl, horizon)


def get_kl_controller(name: str) -> KLControllerFactory:
    """The controller factory registered as ``name`` (raises, listing valid names, if unknown)."""
    return KL_CONTROLLER_REGISTRY.get(name)


def make_kl_controller(
    name: str, *, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> KLController:
    """Build the ``fixed`` or ``adaptive`` controller (``algorithm.kl_ctrl.type``)."""
    return get_kl_controller(name)(kl_coef, target_kl, horizon)


KL_CONTROLLERS: tuple[str, ...] = KL_CONTROLLER_REGISTRY.names()


# ---------------------------------------------------------------------------------------------------
# KL as a loss term
# ---------------------------------------------------------------------------------------------------


class KLLossOutput(NamedTuple):
    """``loss`` = kl_loss_coef · agg(KL), to add to the actor loss; ``kl_loss`` = agg(KL), detached."""

    loss: Tensor
    kl_loss: Tensor


def compute_kl_loss(
    *,
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_loss_coef: float,
    kl_loss_type: str,
    loss_agg_mode: str,
    norm: AggNorm | None = None,
) -> KLLossOutput:
    """KL(π_θ ‖ π_ref) as a loss term (Shao et al. 2024, eq. 3, which uses k3 = ``low_var_kl``).

    Args:
        log_prob: ``(B, T)`` log π_θ (differentiable).
        ref_log_prob: ``(B, T)`` log π_ref.
        response_mask: ``(B, T)``.
        kl_loss_coef: β of the loss term.
        kl_loss_type: one of :data:`KL_ESTIMATORS`.
        loss_agg_mode, norm: as in :func:`~verl_core.algorithms.aggregation.aggregate_loss`.
    """
    kl = get_kl_estimator(kl_loss_type)(log_prob, ref_log_prob)  # (B, T)
    aggregated = aggregate_loss(kl, response_mask, loss_agg_mode, norm)
    return KLLossOutput(loss=kl_loss_coef * aggregated, kl_loss=aggregated.detach())
