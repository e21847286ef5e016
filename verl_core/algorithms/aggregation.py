"""Loss aggregation (``actor.loss_agg_mode``) and the entropy bonus.

A per-token loss ``(B, T)`` becomes a scalar in one of four ways (m = mask, l = per-token loss,
n_i = Σ_t m_it valid tokens of sequence i):

=========================== ========================================= ==================================
mode                        mini-batch loss                           used by
=========================== ========================================= ==================================
``token-mean``              Σ_it m·l / Σ_it m                         DAPO (Yu et al. 2025), verl default
``seq-mean-token-sum``      (1/S) Σ_i Σ_t m·l                         sequence-level sum
``seq-mean-token-mean``     (1/S) Σ_i (Σ_t m·l / n_i)                 original GRPO, GSPO
``seq-mean-token-sum-norm`` Σ_it m·l / H  (H a constant horizon)      Dr.GRPO (Liu et al. 2025)
=========================== ========================================= ==================================

``seq-mean-token-sum-norm`` follows verl: the token sum is divided by the constant H only (not by S),
so its scale grows with the mini-batch size; H should be the maximum response length.

Micro-batches
-------------
Every denominator above is a property of the whole *mini-batch* (the batch one optimiser step sees),
never of a micro-batch: Σ m over the mini-batch, its number of sequences S, and the constant H.
:func:`agg_norm_for` computes them once from the mini-batch mask, and :func:`aggregate_loss` of each
micro-batch divides by them, so the micro-batch losses (and their gradients) *sum* to the mini-batch
loss exactly. Backpropagate each micro-batch loss as is; do not divide by the number of micro-batches::

    norm = agg_norm_for(mini_batch_mask, horizon=max_response_length)
    for micro in micro_batches:
        loss = aggregate_loss(per_token_loss(micro), micro.mask, "token-mean", norm)
        loss.backward()          # gradients accumulate to those of the mini-batch loss

The per-sequence term n_i of ``seq-mean-token-mean`` needs no care: a sequence is never split.
With data parallelism over R ranks whose gradients are *averaged*, build ``AggNorm`` from the counts
summed over all ranks and multiply each loss by R (or divide the counts by R).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

import torch
from torch import Tensor

from verl_core.algorithms.stats import masked_sum
from verl_core.registry import Registry


class AggNorm(NamedTuple):
    """Denominators of loss aggregation, taken over the whole mini-batch.

    Attributes:
        num_tokens: Σ mask over the mini-batch (``token-mean``).
        num_seqs: number of sequences S in the mini-batch (``seq-mean-*``).
        horizon: constant H of ``seq-mean-token-sum-norm`` (the maximum response length).
    """

    num_tokens: float
    num_seqs: float
    horizon: float


def agg_norm_for(mask: Tensor, horizon: float | None = None) -> AggNorm:
    """The :class:`AggNorm` of a mini-batch with response mask ``mask (B, T)``.

    Args:
        mask: ``(B, T)`` of the *whole* mini-batch.
        horizon: constant H for ``seq-mean-token-sum-norm``; ``None`` uses ``T`` (only constant if every
            batch is padded to the same length, so pass the maximum response length).
    """
    return AggNorm(
        num_tokens=float(mask.to(torch.float32).sum()),
        num_seqs=float(mask.shape[0]),
        horizon=float(mask.shape[-1] if horizon is None else horizon),
    )


class Aggregator(Protocol):
    """Turns a per-token loss ``(B, T)`` and its mask ``(B, T)`` into a scalar using ``norm``."""

    def __call__(self, loss_mat: Tensor, mask: Tensor, norm: AggNorm) -> Tensor: ...


LOSS_AGG_REGISTRY: Registry[Aggregator] = Registry("loss aggregation mode")

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@LOSS_AGG_REGISTRY.register("token-mean")
def _token_mean(loss_mat: Tensor, mask: Tensor, norm: AggNorm) -> Tensor:
    # Σ_it m·l / N_tokens(mini-batch)
    return masked_sum(loss_mat, mask) / max(norm.num_tokens, 1.0)


@LOSS_AGG_REGISTRY.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, norm: AggNorm) -> Tensor:
    # (1/S) Σ_i Σ_t m·l
    return masked_sum(loss_mat, mask) / max(norm.num_seqs, 1.0)


@LOSS_AGG_REGISTRY.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, norm: AggNorm) -> Tensor:
    # (1/S) Σ_i (Σ_t m·l / n_i); an empty sequence contributes 0
    seq_len = mask.to(loss_mat.dtype).sum(dim=-1).clamp_min(1.0)  # (B,)
    seq_mean = masked_sum(loss_mat, mask, dim=-1) / seq_len  # (B,)
    return seq_mean.sum() / max(norm.num_seqs, 1.0)


@LOSS_AGG_REGISTRY.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, norm: AggNorm) -> Tensor:
    # Σ_it m·l / H  (verl's Dr.GRPO normalisation)
    return masked_sum(loss_mat, mask) / norm.horizon


def aggregate_loss(loss_mat: Tensor, mask: Tensor, loss_agg_mode: str, norm: AggNorm | None = None) -> Tensor:
    """Aggregate a per-token loss into a scalar (see the module docstring for the formulas).

    Args:
        loss_mat: ``(B, T)`` per-token loss.
        mask: ``(B, T)`` tokens that count.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        norm: denominators of the whole mini-batch; ``None`` treats this batch as the whole mini-batch
            (``agg_norm_for(mask)``). Pass it explicitly when splitting into micro-batches.

    Returns:
        scalar tensor.
    """
    aggregator = LOSS_AGG_REGISTRY.get(loss_agg_mode)
    return aggregator(loss_mat, mask, agg_norm_for(mask) if norm is None else norm)


LOSS_AGG_MODES: tuple[str, ...] = LOSS_AGG_REGISTRY.names()


# ---------------------------------------------------------------------------------------------------
# Entropy bonus
# ---------------------------------------------------------------------------------------------------


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy of the softmax over the vocabulary.

    H = −Σ_v p_v log p_v = logsumexp(z) − Σ_v p_v z_v.

    Args:
        logits: ``(B, T, V)`` (or ``(N, V)`` packed).

    Returns:
        ``(B, T)`` (or ``(N,)``).
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


class EntropyBonus(NamedTuple):
    """Result of :func:`entropy_bonus`.

    Attributes:
        loss: scalar to *add* to the actor loss, −c·H̄ (maximising entropy).
        entropy: scalar aggregated entropy H̄, detached (the ``actor/entropy`` metric).
    """

    loss: Tensor
    entropy: Tensor


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    entropy_coeff: float,
    loss_agg_mode: str,
    norm: AggNorm | None = None,
) -> EntropyBonus:
    """Entropy regularisation term of the actor loss (Schulman et al. 2017, eq. 9: L = L_clip − c₂·S).

    Args:
        entropy: ``(B, T)`` per-token entropies (:func:`entropy_from_logits`).
        mask: ``(B, T)``.
        entropy_coeff: c₂ ≥ 0.
        loss_agg_mode, norm: as in :func:`aggregate_loss`.
    """
    aggregated = aggregate_loss(entropy, mask, loss_agg_mode, norm)
    return EntropyBonus(loss=-entropy_coeff * aggregated, entropy=aggregated.detach())
