"""Supervised fine-tuning loss on packed batches: next-token NLL over assistant tokens only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from verl_core.models.packed import PackedCausalLM
from verl_core.training.data_parallel import DPView, MicroBatch, dp_micro_batches


def count_loss_tokens(loss_masks: Sequence[Sequence[int]]) -> int:
    """Tokens that are prediction targets in the loss: masked tokens except each sequence's first
    (nothing predicts the first token)."""
    return sum(int(sum(m[1:])) for m in loss_masks)


class SFTStepPlan(NamedTuple):
    """One SFT optimizer step on this rank.

    micro_batches    this rank's micro-batches, padded to the count every rank runs (a padding
                     micro-batch has weight 0: multiply its loss by ``mb.weight``)
    num_loss_tokens  loss targets of the whole step, all ranks: the normaliser of :func:`sft_loss`
    """

    micro_batches: list[MicroBatch]
    num_loss_tokens: int


def sft_step_plan(
    rows: Sequence[int],
    lengths: Sequence[int],
    loss_masks: Sequence[Sequence[int]],
    budget: int,
    dp: DPView,
) -> SFTStepPlan:
    """Split one optimizer step's ``rows`` (the same on every rank) over the data-parallel ranks
    (Karmarkar–Karp on ``lengths``) into token-budget micro-batches, padded to a common count so every
    rank makes the same FSDP2/ZeRO-3 collective calls; ``lengths[i]``, ``loss_masks[i]``: row i's."""
    micro = dp_micro_batches(rows, lengths, budget, dp)
    return SFTStepPlan(micro, count_loss_tokens([loss_masks[i] for i in rows]))


def target_mask(loss_mask: Tensor, has_target: Tensor) -> Tensor:
    """``(N,)`` float mask of positions whose *target* (the next token) is a loss token.

    Position t predicts token t+1, so it counts when ``loss_mask[t+1] == 1`` and t is not the last
    token of its sequence (``has_target``)."""
    shifted = torch.zeros_like(loss_mask, dtype=torch.float32)
    shifted[:-1] = loss_mask[1:].float()
    return shifted * has_target.float()


def sft_loss(
    model: PackedCausalLM,
    input_ids: Tensor,
    cu_seqlens: Tensor,
    loss_mask: Tensor,
    *,
    num_loss_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Σ_t −log p(x_{t+1} | x_≤t) over loss targets / ``num_loss_tokens`` (the *mini-batch* count, so
    micro-batch losses sum to the mini-batch token-mean).

    Args: ``input_ids (N,)``, ``cu_seqlens (S+1,)``, ``loss_mask (N,)`` (1 on assistant tokens).
    Returns ``(loss, summed nll (detached))``."""
    out, has_target = model(input_ids, cu_seqlens, with_entropy=False)
    mask = target_mask(loss_mask, has_target)
    nll_sum = -(out.log_probs * mask).sum()
    return nll_sum / max(1, num_loss_tokens), nll_sum.detach()
