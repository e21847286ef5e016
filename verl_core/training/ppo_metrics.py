"""The metric accounting of one PPO iteration: micro-batch metrics → iteration means that do not
depend on micro-batching nor on the data-parallel split (:class:`MetricLog`), and the data metrics of
the whole batch (:func:`batch_metrics`)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from verl_core.algorithms import masked_mean
from verl_core.training.data_parallel import DPView, sum_over_ranks

__all__ = ["LOSS_METRICS", "MetricLog", "batch_metrics", "zero_variance_share"]

# the loss metrics are summed over the micro-batches of a mini-batch (each is its share of the
# mini-batch loss), then averaged over mini-batches; every other micro-batch metric is a token mean,
# combined weighted by the micro-batch's tokens
LOSS_METRICS = frozenset({"actor/pg_loss", "actor/kl_loss", "critic/vf_loss"})


class MetricLog:
    """Micro-batch metrics → iteration means that do not depend on how mini-batches are split, nor
    on how they are shared among data-parallel ranks.

    Per rank: the loss shares of each mini-batch (summed), Σ value·tokens and Σ tokens of every
    token-mean metric; :meth:`means` sums them over the ranks (one all-reduce) and divides. A padding
    micro-batch (weight 0) records zeros, so every rank holds the same keys and step counts."""

    def __init__(self) -> None:
        self.losses: dict[str, float] = defaultdict(float)  # current mini-batch's loss sums (this rank)
        self.step_losses: dict[str, list[float]] = defaultdict(list)  # per step, summed over ranks later
        self.per_step: dict[str, list[float]] = defaultdict(list)  # per step, already global
        self.weighted: dict[str, float] = defaultdict(float)  # Σ value·tokens
        self.tokens: dict[str, float] = defaultdict(float)  # Σ tokens

    def micro(self, metrics: dict[str, float], tokens: float, weight: float = 1.0) -> None:
        for k, v in metrics.items():
            if k in LOSS_METRICS:
                self.losses[k] += v * weight
            else:
                self.weighted[k] += v * tokens * weight
                self.tokens[k] += tokens * weight

    def step(self, metrics: dict[str, float]) -> None:
        """End of a mini-batch (one optimizer step): its loss sums become one value each; ``metrics``
        (grad norm, lr) are the same on every rank."""
        for k, v in self.losses.items():
            self.step_losses[k].append(v)
        for k, v in metrics.items():
            self.per_step[k].append(v)
        self.losses.clear()

    def means(self, dp: DPView) -> dict[str, float]:
        losses, weighted = sorted(self.step_losses), sorted(self.weighted)
        flat = [v for k in losses for v in self.step_losses[k]]
        flat += [self.weighted[k] for k in weighted] + [self.tokens[k] for k in weighted]
        summed = sum_over_ranks(torch.tensor(flat, dtype=torch.float64), dp).tolist()
        out = {k: sum(v) / len(v) for k, v in self.per_step.items() if v}
        at = 0
        for k in losses:  # each step's loss: Σ over ranks of the rank's shares
            n = len(self.step_losses[k])
            out[k] = sum(summed[at : at + n]) / n
            at += n
        num, den = summed[at : at + len(weighted)], summed[at + len(weighted) :]
        out.update({k: a / b for k, a, b in zip(weighted, num, den, strict=True) if b > 0})
        return out


def batch_metrics(
    scores: Tensor,
    token_scores: Tensor,
    adv: Tensor,
    returns: Tensor,
    values: Tensor | None,
    mask: Tensor,
    group_ids: Tensor,
) -> dict[str, float]:
    """verl's data metrics (``critic/...``) of the whole batch, plus two that say why a run is flat:
    ``critic/advantages/abs_mean`` (mean |Â_t| over response tokens: how hard the batch pushes) and
    ``batch/zero_variance_groups`` (share of the prompt groups of two or more samples whose outcome
    scores are all equal: a group-relative estimator gives them zero advantage; absent without such
    groups). ``scores`` (S,), ``token_scores``/``adv``/``returns``/``values``/``mask`` (S, R),
    ``group_ids`` (S,)."""
    seq_rewards = (token_scores * mask).sum(-1)  # (S,)
    out = {
        "critic/score/mean": float(scores.mean()),
        "critic/rewards/mean": float(seq_rewards.mean()),
        "critic/advantages/mean": float(masked_mean(adv, mask)),
        "critic/advantages/abs_mean": float(masked_mean(adv.abs(), mask)),
        "critic/advantages/max": float(adv[mask.bool()].max()) if mask.any() else 0.0,
        "critic/returns/mean": float(masked_mean(returns, mask)),
        "response_length/mean": float(mask.sum(-1).mean()),
    }
    if values is not None:
        out["critic/values/mean"] = float(masked_mean(values, mask))
    zero_variance = zero_variance_share(scores, group_ids.to(scores.device))
    if zero_variance is not None:
        out["batch/zero_variance_groups"] = zero_variance
    return out


def zero_variance_share(scores: Tensor, group_ids: Tensor) -> float | None:
    """Share of the groups of ≥ 2 samples whose ``scores`` (S,) are all equal (max = min), groups by
    ``group_ids`` (S,); None when no group has two samples."""
    _, group = torch.unique(group_ids, return_inverse=True)  # (S,) in 0..G-1
    size = torch.bincount(group)  # (G,)
    hi = torch.full(size.shape, -torch.inf, dtype=scores.dtype, device=scores.device)
    lo = torch.full(size.shape, torch.inf, dtype=scores.dtype, device=scores.device)
    hi = hi.scatter_reduce(0, group, scores, reduce="amax")  # (G,) max score of each group
    lo = lo.scatter_reduce(0, group, scores, reduce="amin")  # (G,) min score of each group
    several = size >= 2
    if not several.any():
        return None
    return float(((hi == lo) & several).sum() / several.sum())
