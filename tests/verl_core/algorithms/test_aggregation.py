"""Loss aggregation: the four modes by hand, micro-batch invariance, entropy bonus."""

import math

import pytest
import torch

from verl_core.algorithms import (
    LOSS_AGG_MODES,
    agg_norm_for,
    aggregate_loss,
    entropy_bonus,
    entropy_from_logits,
)

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2 sequences
        ("seq-mean-token-mean", 2.75),  # ((1 + 2)/2 + 4/1) / 2 = (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 7 / 3),  # (1 + 2 + 4) / H, H = T = 3 by default
    ],
)
def test_modes_by_hand(mode: str, expected: float) -> None:
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_sum_norm_uses_the_given_horizon() -> None:
    # (1 + 2 + 4) / 10
    norm = agg_norm_for(MASK, horizon=10)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm).item() == pytest.approx(0.7)


def test_agg_norm_for_counts_the_mini_batch() -> None:
    norm = agg_norm_for(MASK, horizon=16)
    assert (norm.num_tokens, norm.num_seqs, norm.horizon) == (3.0, 2.0, 16.0)


def _ragged_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 7, 3, 10, 2, 5, 8, 4])
    mask = (torch.arange(10)[None, :] < lengths[:, None]).long()  # (8, 10)
    x = torch.randn(8, 10, generator=gen, dtype=torch.float64)
    weight = torch.randn(10, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, mask, weight


def _per_token_loss(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.sin(x * weight[: x.shape[1]]) + x**2


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_losses_and_grads_sum_to_the_mini_batch(mode: str) -> None:
    x, mask, weight = _ragged_batch(seed=0)
    norm = agg_norm_for(mask, horizon=10)
    full = aggregate_loss(_per_token_loss(x, weight), mask, mode, norm)
    (full_grad,) = torch.autograd.grad(full, weight)

    # Micro-batches of 3, 3 and 2 rows, each trimmed to its own longest row (different T).
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 3), slice(3, 6), slice(6, 8)):
        t_micro = int(mask[rows].sum(-1).max())
        micro_x, micro_mask = x[rows, :t_micro], mask[rows, :t_micro]
        total = total + aggregate_loss(_per_token_loss(micro_x, weight), micro_mask, mode, norm)
    (micro_grad,) = torch.autograd.grad(total, weight)

    torch.testing.assert_close(total, full)
    torch.testing.assert_close(micro_grad, full_grad)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_local_normalisers_would_be_wrong(mode: str) -> None:
    # Guard that the invariance test above is not trivially true: dividing each micro-batch by its own
    # counts and averaging over micro-batches does not give the mini-batch loss on this ragged batch.
    x, mask, weight = _ragged_batch(seed=0)
    full = aggregate_loss(_per_token_loss(x, weight), mask, mode)
    local = [aggregate_loss(_per_token_loss(x[r], weight), mask[r], mode) for r in (slice(0, 3), slice(3, 8))]
    naive = (local[0] + local[1]) / 2
    assert not torch.isclose(naive, full)


def test_entropy_from_logits() -> None:
    # uniform over 4: ln 4 = 1.386294; p = (0.25, 0.75): −(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335.
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.tensor([[1.386294, 0.562335]]), atol=1e-6, rtol=0
    )


def test_entropy_bonus() -> None:
    # token-mean entropy over the mask: (1 + 2 + 3) / 3 = 2; loss term −0.01·2 = −0.02.
    entropy = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    bonus = entropy_bonus(entropy, torch.tensor([[1, 1], [1, 0]]), 0.01, "token-mean")
    assert bonus.loss.item() == pytest.approx(-0.02)
    assert bonus.entropy.item() == pytest.approx(2.0) and not bonus.entropy.requires_grad
    bonus.loss.backward()
    # d(−0.01·mean)/dH = −0.01/3 on valid tokens.
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.01 / 3, -0.01 / 3], [-0.01 / 3, 0.0]]))
