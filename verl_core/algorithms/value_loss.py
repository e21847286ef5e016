"""Clipped value (critic) loss."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from verl_core.algorithms.aggregation import AggNorm, aggregate_loss
from verl_core.algorithms.stats import masked_mean, masked_var


class ValueLossStats(NamedTuple):
    """Detached scalar metrics of the value loss (``stats._asdict()`` gives a metrics dict).

    Attributes:
        vf_clipfrac: fraction of tokens where the clipped error is the larger one.
        vf_explained_var: 1 − Var(R − V) / Var(R) over the mask (1 = perfect, ≤ 0 = no better than
            predicting the mean return).
    """

    vf_clipfrac: Tensor
    vf_explained_var: Tensor


class ValueLossOutput(NamedTuple):
    """Aggregated scalar ``loss`` and its :class:`ValueLossStats`."""

    loss: Tensor
    stats: ValueLossStats


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 − Var(R − V) / Var(R) over the masked positions (a scalar; 0 if the returns are constant).

    Args:
        values: ``(B, T)`` predictions V.
        returns: ``(B, T)`` targets R.
        mask: ``(B, T)``.
    """
    var_returns = masked_var(returns, mask, unbiased=False)
    var_residual = masked_var(returns - values, mask, unbiased=False)
    explained = 1.0 - var_residual / var_returns.clamp_min(1e-8)
    return torch.where(var_returns > 1e-8, explained, torch.zeros_like(explained))


def compute_value_loss(
    *,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    norm: AggNorm | None = None,
) -> ValueLossOutput:
    """PPO clipped value loss (OpenAI baselines ppo2; analysed in Andrychowicz et al. 2021, "What Matters").

    V_clip = V_old + clip(V − V_old, −c, c)
    L_t = 0.5 · max((V − R)², (V_clip − R)²)

    Args:
        values: ``(B, T)`` V_θ of the critic being trained (differentiable).
        old_values: ``(B, T)`` V_old computed when the batch was collected.
        returns: ``(B, T)`` return targets R.
        response_mask: ``(B, T)``.
        cliprange_value: c.
        loss_agg_mode, norm: as in :func:`~verl_core.algorithms.aggregation.aggregate_loss`.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    losses_unclipped = (values - returns) ** 2
    losses_clipped = (clipped_values - returns) ** 2
    losses = 0.5 * torch.maximum(losses_unclipped, losses_clipped)
    # the clip is active where V left the trust region and the clipped loss is the larger one; inside
    # the region V_clip = V_old + (V − V_old) can differ from V by an ulp, which must not count
    clipped = ((values - old_values).abs() > cliprange_value) & (losses_clipped > losses_unclipped)
    stats = ValueLossStats(
        vf_clipfrac=masked_mean(clipped.to(losses.dtype), response_mask).detach(),
        vf_explained_var=explained_variance(values.detach(), returns, response_mask),
    )
    return ValueLossOutput(loss=aggregate_loss(losses, response_mask, loss_agg_mode, norm), stats=stats)
