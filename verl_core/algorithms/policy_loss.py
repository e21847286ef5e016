"""Policy (actor) losses, chosen by ``actor.policy_loss``.

Every loss has one keyword-only signature (:class:`PolicyLoss`) and returns
:class:`PolicyLossOutput` ``(loss, stats)``; the per-token loss is aggregated with
:func:`~verl_core.algorithms.aggregation.aggregate_loss` (see there for micro-batches).
Metrics (all detached scalars, token-means over the mask of the batch given):

- ``pg_clipfrac``: fraction of tokens where the clipped term is the larger loss (the clip is active);
- ``pg_clipfrac_lower``: fraction where the dual clip is active (A < 0 and ratio > clip_ratio_c);
- ``ppo_kl``: mean of old_logp − logp, a k1 estimate of KL(π_old ‖ π_θ).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

import torch
from torch import Tensor

from verl_core.algorithms.aggregation import AggNorm, aggregate_loss
from verl_core.algorithms.stats import masked_mean
from verl_core.registry import Registry


class PolicyLossStats(NamedTuple):
    """Detached scalar metrics of a policy loss (``stats._asdict()`` gives a metrics dict)."""

    pg_clipfrac: Tensor
    pg_clipfrac_lower: Tensor
    ppo_kl: Tensor


class PolicyLossOutput(NamedTuple):
    """Aggregated scalar ``loss`` (to minimise) and its :class:`PolicyLossStats`."""

    loss: Tensor
    stats: PolicyLossStats


class PolicyLoss(Protocol):
    """The signature every registered policy loss has.

    Args:
        log_prob: ``(B, T)`` log π_θ(y_t) of the current policy (differentiable).
        old_log_prob: ``(B, T)`` log π_old(y_t) of the policy that generated the data.
        advantages: ``(B, T)``.
        response_mask: ``(B, T)``.
        loss_agg_mode: one of ``LOSS_AGG_MODES`` (GSPO is meant for ``seq-mean-token-mean``).
        clip_ratio_low: ε_low, the ratio is clipped below at 1 − ε_low.
        clip_ratio_high: ε_high, the ratio is clipped above at 1 + ε_high (> ε_low is DAPO's clip-higher).
        clip_ratio_c: dual-clip bound c > 1 for A < 0; ``None`` disables it (``vanilla`` only).
        norm: mini-batch denominators for micro-batching (``None``: this batch is the mini-batch).
        rollout_is_weights: ``(B, T)`` detached importance weights π_old/π_behaviour multiplying the
            per-token loss (:mod:`~verl_core.algorithms.rollout_correction`); ``None``: no correction.
    """

    def __call__(
        self,
        *,
        log_prob: Tensor,
        old_log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str,
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.2,
        clip_ratio_c: float | None = 3.0,
        norm: AggNorm | None = None,
        rollout_is_weights: Tensor | None = None,
    ) -> PolicyLossOutput: ...


POLICY_LOSS_REGISTRY: Registry[PolicyLoss] = Registry("policy loss")

PolicyLossName = Literal["vanilla", "gspo"]


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name`` (raises, listing valid names, if unknown)."""
    return POLICY_LOSS_REGISTRY.get(name)


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic clipped surrogate per token (Schulman et al. 2017, eq. 7), as a loss.

    L1 = −A·ρ,  L2 = −A·clip(ρ, 1 − ε_low, 1 + ε_high),  L = max(L1, L2).

    Returns:
        ``(L (B, T), clipped (B, T) bool)`` where ``clipped`` marks L2 > L1.
    """
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(pg_losses1, pg_losses2), pg_losses2 > pg_losses1


@POLICY_LOSS_REGISTRY.register("vanilla")
def compute_ppo_policy_loss(
    *,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    norm: AggNorm | None = None,
    rollout_is_weights: Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with clip-higher and dual clip.

    ρ_t = exp(clamp(log π_θ − log π_old, −20, 20))               (clamp: avoid overflow)
    L_t = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))           (Schulman et al. 2017, eq. 7;
                                                                   ε_low ≠ ε_high: Yu et al. 2025, §3.1)
    where A < 0:  L_t = min(L_t, −A·c)                            (dual clip, Ye et al. 2020, eq. 5)
    L_t ← w_t · L_t  with rollout_is_weights w (rollout correction; the ratio stays on π_old)
    """
    mask = response_mask
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    losses, clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    clipfrac_lower = torch.zeros((), dtype=losses.dtype, device=losses.device)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1.0 for the dual clip, got {clip_ratio_c}")
        pg_losses3 = -advantages * clip_ratio_c  # the bound −A·c, active only for A < 0
        negative = advantages < 0
        clipfrac_lower = masked_mean((negative & (losses > pg_losses3)).to(losses.dtype), mask)
        losses = torch.where(negative, torch.minimum(losses, pg_losses3), losses)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    stats = PolicyLossStats(
        pg_clipfrac=masked_mean(clipped.to(losses.dtype), mask).detach(),
        pg_clipfrac_lower=clipfrac_lower.detach(),
        ppo_kl=masked_mean(-log_ratio, mask).detach(),
    )
    return PolicyLossOutput(loss=aggregate_loss(losses, mask, loss_agg_mode, norm), stats=stats)


@POLICY_LOSS_REGISTRY.register("gspo")
def compute_gspo_policy_loss(
    *,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    norm: AggNorm | None = None,
    rollout_is_weights: Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO: PPO clip on the sequence-level importance ratio (Zheng et al. 2025, eq. 5–7, GSPO-token).

    log s_i = (1/n_i) Σ_t m_t (log π_θ − log π_old)                (length-normalised sequence ratio)
    s_it = sg(s_i) · π_θ(y_t) / sg(π_θ(y_t))                       (value s_i, gradient s_i·∇log π_θ(y_t))
    L_it = max(−A·s_it, −A·clip(s_it, 1 − ε_low, 1 + ε_high)),  then × rollout_is_weights if given

    The paper's ε are ~1e-4 (e.g. ε_low = 3e-4, ε_high = 4e-4) and the aggregation
    ``seq-mean-token-mean``. ``clip_ratio_c`` is ignored (no dual clip); ``pg_clipfrac_lower`` is 0.
    The log ratio is clamped at 10 before exp, as in verl.
    """
    mask = response_mask
    log_ratio = log_prob - old_log_prob  # (B, T)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # (B,)
    token_log_ratio = seq_log_ratio.detach()[:, None] + log_prob - log_prob.detach()  # (B, T)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    losses, clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    stats = PolicyLossStats(
        pg_clipfrac=masked_mean(clipped.to(losses.dtype), mask).detach(),
        pg_clipfrac_lower=torch.zeros((), dtype=losses.dtype, device=losses.device),
        ppo_kl=masked_mean(-log_ratio, mask).detach(),
    )
    return PolicyLossOutput(loss=aggregate_loss(losses, mask, loss_agg_mode, norm), stats=stats)


POLICY_LOSSES: tuple[str, ...] = POLICY_LOSS_REGISTRY.names()
