"""Clipped value loss by hand, its gradient, explained variance, micro-batching."""

import pytest
import torch

from verl_core.algorithms import agg_norm_for, compute_value_loss, explained_variance

F64 = torch.float64

# c = 0.2. Tokens (V, V_old, R):
#   t1 (1.0, 1.5, 0.0): V − V_old = −0.5 -> clip −0.2, V_clip = 1.3;
#       (V−R)² = 1, (V_clip−R)² = 1.69 -> ½·1.69 = 0.845, clipped
#   t2 (2.0, 1.0, 2.5): +1 -> +0.2, V_clip = 1.2; 0.25 vs 1.69 -> 0.845, clipped
#   t3 (0.0, 0.0, 1.0): V_clip = V; 1 vs 1 -> 0.5, not clipped
#   t4 (3.0, 3.1, 3.0): −0.1 inside, V_clip = V; 0 -> 0
#   t5, t6 masked out (V = 100).
VALUES = torch.tensor([[1.0, 2.0, 0.0], [3.0, 100.0, 100.0]], dtype=F64)
OLD_VALUES = torch.tensor([[1.5, 1.0, 0.0], [3.1, 0.0, 0.0]], dtype=F64)
RETURNS = torch.tensor([[0.0, 2.5, 1.0], [3.0, 0.0, 0.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_value_loss_hand_example() -> None:
    values = VALUES.clone().requires_grad_(True)
    loss, stats = compute_value_loss(
        values=values,
        old_values=OLD_VALUES,
        returns=RETURNS,
        response_mask=MASK,
        cliprange_value=0.2,
        loss_agg_mode="token-mean",
    )
    # (0.845 + 0.845 + 0.5 + 0) / 4 = 0.5475
    assert loss.item() == pytest.approx(0.5475)
    assert stats.vf_clipfrac.item() == pytest.approx(0.5)  # t1, t2
    # R = 0, 2.5, 1, 3 (var 5.6875/4 = 1.421875); R − V = −1, 0.5, 1, 0 (var 2.1875/4 = 0.546875)
    # 1 − 0.546875/1.421875 = 0.615385
    assert stats.vf_explained_var.item() == pytest.approx(0.615385, abs=1e-6)
    # Gradient: t1, t2 use the clipped (constant) prediction -> 0; t3: (V − R)/4 = −0.25; t4: 0.
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, -0.25], [0.0, 0.0, 0.0]], dtype=F64))


def test_explained_variance_edge_cases() -> None:
    mask = torch.ones(1, 4)
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)  # perfect
    # predicting the mean (2.5) explains nothing: 1 − var(R)/var(R) = 0
    assert explained_variance(torch.full((1, 4), 2.5), returns, mask).item() == pytest.approx(0.0)
    # constant returns: defined as 0 rather than dividing by zero
    assert explained_variance(returns, torch.ones(1, 4), mask).item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_value_loss_micro_batches_sum_to_mini_batch(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(5)[None, :] < torch.tensor([1, 5, 3, 2])[:, None]).long()
    values = torch.randn(4, 5, generator=gen, dtype=F64, requires_grad=True)
    old = values.detach() + 0.3 * torch.randn(4, 5, generator=gen, dtype=F64)
    returns = torch.randn(4, 5, generator=gen, dtype=F64)
    norm = agg_norm_for(mask)

    def run(rows: slice) -> torch.Tensor:
        return compute_value_loss(
            values=values[rows],
            old_values=old[rows],
            returns=returns[rows],
            response_mask=mask[rows],
            cliprange_value=0.2,
            loss_agg_mode=mode,
            norm=norm,
        ).loss

    full = run(slice(0, 4))
    (full_grad,) = torch.autograd.grad(full, values)
    micro = run(slice(0, 1)) + run(slice(1, 4))
    (micro_grad,) = torch.autograd.grad(micro, values)
    torch.testing.assert_close(micro, full)
    torch.testing.assert_close(micro_grad, full_grad)
