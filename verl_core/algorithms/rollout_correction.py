"""Rollout/trainer mismatch: its metrics, and its correction by importance weights or rejection.

Three policies meet in one PPO update (decoupled PPO: Hilton et al. 2021, "Batch size-invariance for
policy optimization", §3; applied to the inference/training mismatch by Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training" (TIS) and Liu, Li et al. 2025,
"When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch" (MIS/RS)):

- π_beh, the rollout engine that sampled the tokens (its log-probs are in the rollout artifact);
- π_old, the trainer's recomputation of the same weights (the *proximal* policy);
- π_θ, the policy being optimised.

The PPO ratio and its clip stay anchored on π_old (ρ_t = π_θ/π_old); the mismatch is corrected by
a detached importance weight on each token's loss,

    log w_t = log π_old(y_t) − log π_beh(y_t)                           (token level)
    log w_t = Σ_{t'} m_t' (log π_old − log π_beh)(y_t')  for every t    (sequence level: Π_t w_t)
    log w_t = (1/n) Σ_{t'} m_t' (log π_old − log π_beh)(y_t')           (geometric: rejection only)

    L = agg_t( w_t · L_clip,t )

used either **truncated** (TIS, ``rollout_is``: w ← min(w, C), C = ``rollout_is_threshold``) or to
**reject** (RS/MIS, ``rollout_rs``: tokens or whole sequences whose weight leaves
[C_low, C_high] drop out of the loss mask; C_low defaults to 1/C_high). Log weights are clamped to
±20 before exp (e^20 ≈ 4.9e8) as in verl. The levels are a registry (:func:`get_weight_level`).

Metrics use verl's names under ``rollout_corr/`` (``kl``, ``k3_kl``, ``rollout_is_mean``,
``rollout_is_max``, ``rollout_is_ratio_fraction_high``, ``rollout_rs_masked_fraction``,
``rollout_rs_seq_masked_fraction``); verl has no log-prob |Δ| metrics, so ``log_prob_abs_diff_max``
and ``log_prob_abs_diff_frac_above`` are ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import torch
from torch import Tensor

from verl_core.algorithms.stats import masked_mean, masked_sum
from verl_core.registry import Registry

SAFETY_BOUND = 20.0  # |log w| is clamped here before exp

RolloutISLevel = Literal["token", "sequence"]
RolloutRSLevel = Literal["token", "sequence", "geometric"]


class WeightLevel(Protocol):
    """Per-token log weight ``(S, R)`` from the per-token ``log_ratio (S, R)`` and ``mask (S, R)``."""

    def __call__(self, log_ratio: Tensor, mask: Tensor) -> Tensor: ...


WEIGHT_LEVEL_REGISTRY: Registry[WeightLevel] = Registry("rollout correction level")


def get_weight_level(name: str) -> WeightLevel:
    """The weight level registered as ``name`` (raises, listing valid names, if unknown)."""
    return WEIGHT_LEVEL_REGISTRY.get(name)


@WEIGHT_LEVEL_REGISTRY.register("token")
def _token_level(log_ratio: Tensor, mask: Tensor) -> Tensor:
    # log w_t = log π_old(y_t) − log π_beh(y_t)
    return log_ratio * mask


@WEIGHT_LEVEL_REGISTRY.register("sequence")
def _sequence_level(log_ratio: Tensor, mask: Tensor) -> Tensor:
    # log w = Σ_t m_t log ratio_t, the same for every token of the sequence
    return masked_sum(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)  # (S, R)


@WEIGHT_LEVEL_REGISTRY.register("geometric")
def _geometric_level(log_ratio: Tensor, mask: Tensor) -> Tensor:
    # log w = (1/n) Σ_t m_t log ratio_t (the geometric mean of the token weights)
    return masked_mean(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)  # (S, R)


class MismatchStats(NamedTuple):
    """Gap between the trainer's π_old and the engine's π_beh over the response tokens (floats).

    kl: k1 estimate of KL(π_beh ‖ π_old), mean of log π_beh − log π_old (can be < 0);
    k3_kl: k3 estimate of the same KL, mean of r − 1 − log r with r = π_old/π_beh (≥ 0);
    abs_diff_max: max_t |log π_old − log π_beh|;
    abs_diff_frac_above: fraction of tokens with |log π_old − log π_beh| > the threshold given.
    """

    kl: float
    k3_kl: float
    abs_diff_max: float
    abs_diff_frac_above: float

    def metrics(self) -> dict[str, float]:
        return {
            "rollout_corr/kl": self.kl,
            "rollout_corr/k3_kl": self.k3_kl,
            "rollout_corr/log_prob_abs_diff_max": self.abs_diff_max,
            "rollout_corr/log_prob_abs_diff_frac_above": self.abs_diff_frac_above,
        }


def mismatch_stats(
    old_log_prob: Tensor, behaviour_log_prob: Tensor, response_mask: Tensor, *, diff_threshold: float
) -> MismatchStats:
    """The log-prob gap of π_old vs π_beh (Schulman 2020, "Approximating KL divergence": k1, k3).

    Args:
        old_log_prob: ``(S, R)`` log π_old(y_t), the trainer's recomputation.
        behaviour_log_prob: ``(S, R)`` log π_beh(y_t), what the rollout engine sampled with.
        response_mask: ``(S, R)`` tokens that count.
        diff_threshold: |Δ| (nats) above which a token counts in ``abs_diff_frac_above``.
    """
    mask = response_mask
    log_r = (old_log_prob - behaviour_log_prob) * mask  # (S, R) log π_old/π_beh
    k1 = masked_mean(-log_r, mask)  # E_beh[log π_beh − log π_old]
    k3 = masked_mean(torch.exp(log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)) - 1.0 - log_r, mask)
    abs_diff = log_r.abs()  # 0 where masked
    return MismatchStats(
        kl=float(k1),
        k3_kl=float(k3),
        abs_diff_max=float(abs_diff.max()) if mask.any() else 0.0,
        abs_diff_frac_above=float(masked_mean((abs_diff > diff_threshold).float(), mask)),
    )


class ISWeights(NamedTuple):
    """Truncated importance weights and their statistics (before truncation, as verl logs them).

    weights: ``(S, R)`` detached min(w_t, C), 0 where masked;
    mean, max: of w_t over the tokens (clamped at e^20 only);
    fraction_truncated: tokens (token level) or sequences (sequence level) with w > C.
    """

    weights: Tensor
    mean: float
    max: float
    fraction_truncated: float

    def metrics(self) -> dict[str, float]:
        return {
            "rollout_corr/rollout_is_mean": self.mean,
            "rollout_corr/rollout_is_max": self.max,
            "rollout_corr/rollout_is_ratio_fraction_high": self.fraction_truncated,
        }


def truncated_is_weights(
    log_ratio: Tensor, response_mask: Tensor, *, level: str, threshold: float
) -> ISWeights:
    """TIS: w_t = min(exp(log w_t), C) (Yao et al. 2025, eq. 3; Ionides 2008 for truncated IS).

    Args:
        log_ratio: ``(S, R)`` log π_old − log π_beh per token.
        response_mask: ``(S, R)``.
        level: ``token`` or ``sequence`` (``geometric`` is a rejection level only).
        threshold: C > 0.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout_is level must be 'token' or 'sequence', got {level!r}")
    mask = response_mask
    log_w = get_weight_level(level)(log_ratio, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (S, R)
    w = torch.exp(log_w) * mask  # (S, R)
    high = (w > threshold).float()  # (S, R)
    if level == "token":
        truncated = masked_mean(high, mask)
    else:  # one weight per sequence: count the sequences that have tokens
        has_tokens = mask.sum(-1) > 0  # (S,)
        truncated = high[:, 0][has_tokens].mean() if has_tokens.any() else torch.zeros(())
    return ISWeights(
        weights=w.clamp(max=threshold).detach(),
        mean=float(masked_mean(w, mask)),
        max=float(w.max()) if mask.any() else 0.0,
        fraction_truncated=float(truncated),
    )


class Rejection(NamedTuple):
    """Rejection sampling: the loss mask with outliers dropped and the fractions dropped.

    response_mask: ``(S, R)`` the input mask × accept (1: kept, 0: rejected or masked);
    masked_fraction: rejected tokens / tokens;
    seq_masked_fraction: sequences with at least one rejected token / sequences with tokens.
    """

    response_mask: Tensor
    masked_fraction: float
    seq_masked_fraction: float

    def metrics(self) -> dict[str, float]:
        return {
            "rollout_corr/rollout_rs_masked_fraction": self.masked_fraction,
            "rollout_corr/rollout_rs_seq_masked_fraction": self.seq_masked_fraction,
        }


def rejection_mask(
    log_ratio: Tensor, response_mask: Tensor, *, level: str, upper: float, lower: float | None = None
) -> Rejection:
    """RS/MIS: keep a token iff C_low ≤ w_t ≤ C_high (Liu, Li et al. 2025, "masked IS"), where w_t
    is the token's weight at ``level`` (token, sequence or geometric); C_low = 1/C_high if None.

    Args:
        log_ratio: ``(S, R)`` log π_old − log π_beh per token.
        response_mask: ``(S, R)``.
    """
    mask = response_mask
    low = 1.0 / upper if lower is None else lower
    log_w = get_weight_level(level)(log_ratio, mask)  # (S, R)
    # compare in log space: no overflow, and exp(clamp) would hide weights beyond e^±20
    keep = (log_w >= math.log(low)) & (log_w <= math.log(upper))
    rejected = (~keep).float() * mask  # (S, R)
    has_tokens = mask.sum(-1) > 0  # (S,)
    seq_rejected = (rejected.sum(-1) > 0)[has_tokens].float()  # (S_with_tokens,)
    return Rejection(
        response_mask=mask * keep.to(mask.dtype),
        masked_fraction=float(masked_mean(rejected, mask)),
        seq_masked_fraction=float(seq_rejected.mean()) if has_tokens.any() else 0.0,
    )


class RolloutCorrection(NamedTuple):
    """What :func:`rollout_correction` gives the actor loss.

    weights: ``(S, R)`` detached importance weights multiplying the per-token loss (None: no IS);
    response_mask: ``(S, R)`` the actor's loss mask (the input mask, rejected tokens removed);
    metrics: ``rollout_corr/*`` floats (mismatch always; IS and RS statistics when on).
    """

    weights: Tensor | None
    response_mask: Tensor
    metrics: dict[str, float]


@dataclass(frozen=True)
class RolloutCorrectionSpec:
    """Which correction :func:`rollout_correction` applies (``algorithm.rollout_correction`` of the
    config, where the defaults live)."""

    rollout_is: str | None  # TIS weight level: token | sequence; None: no weights
    rollout_is_threshold: float  # truncation C of the weights
    rollout_rs: str | None  # rejection level: token | sequence | geometric; None: no rejection
    rollout_rs_threshold: float  # rejected above
    rollout_rs_threshold_lower: float | None  # rejected below (None: 1 / rollout_rs_threshold)
    log_prob_diff_threshold: float  # |Δ log-prob| counted by log_prob_abs_diff_frac_above

    @property
    def enabled(self) -> bool:
        """Whether the correction changes the loss (weights or rejects tokens); off: metrics only."""
        return self.rollout_is is not None or self.rollout_rs is not None


def rollout_correction(
    old_log_prob: Tensor,
    behaviour_log_prob: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str | None,
    rollout_is_threshold: float,
    rollout_rs: str | None,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float | None,
    diff_threshold: float,
) -> RolloutCorrection:
    """Mismatch metrics, then TIS weights (``rollout_is``), then rejection (``rollout_rs``), each
    independent of the other (both may be on). Inputs ``(S, R)``; see the module docstring.
    A whole batch gives the same result on every data-parallel rank (no collective)."""
    mask = response_mask
    log_ratio = (old_log_prob - behaviour_log_prob) * mask  # (S, R) log π_old/π_beh
    metrics = mismatch_stats(old_log_prob, behaviour_log_prob, mask, diff_threshold=diff_threshold).metrics()
    weights = None
    if rollout_is is not None:
        tis = truncated_is_weights(log_ratio, mask, level=rollout_is, threshold=rollout_is_threshold)
        weights = tis.weights
        metrics.update(tis.metrics())
    if rollout_rs is not None:
        rs = rejection_mask(
            log_ratio, mask, level=rollout_rs, upper=rollout_rs_threshold, lower=rollout_rs_threshold_lower
        )
        mask = rs.response_mask
        metrics.update(rs.metrics())
    return RolloutCorrection(weights=weights, response_mask=mask, metrics=metrics)


WEIGHT_LEVELS: tuple[str, ...] = WEIGHT_LEVEL_REGISTRY.names()
