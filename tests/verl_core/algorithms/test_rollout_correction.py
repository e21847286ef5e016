"""Rollout correction: mismatch metrics, TIS weights (token/sequence), rejection masks, all by hand."""

import math

import pytest
import torch

from verl_core.algorithms import (
    UnknownNameError,
    get_policy_loss,
    get_weight_level,
    mismatch_stats,
    rejection_mask,
    rollout_correction,
    truncated_is_weights,
)

F64 = torch.float64

# Two rows (R = 3), the last token of row 1 masked. Token weights w = π_old/π_beh chosen by hand:
#   row 0: w = 3.0, 0.6, 1.0     → sequence weight 3·0.6·1 = 1.8,    geometric 1.8^(1/3) = 1.2164
#   row 1: w = 1.5, 0.25, (7.0)  → sequence weight 1.5·0.25 = 0.375, geometric √0.375 = 0.6124
W = torch.tensor([[3.0, 0.6, 1.0], [1.5, 0.25, 7.0]], dtype=F64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -2.0]], dtype=F64)
BEH = OLD - W.log()  # log π_beh = log π_old − log w
LOG_RATIO = (OLD - BEH) * MASK


def test_mismatch_stats_by_hand() -> None:
    stats = mismatch_stats(OLD, BEH, MASK, diff_threshold=0.5)
    # log w = ln3 = 1.098612, ln0.6 = −0.510826, 0, ln1.5 = 0.405465, ln0.25 = −1.386294 (sum −0.393043)
    # k1 = mean(log π_beh − log π_old) = mean(−log w) = 0.393043 / 5
    assert stats.kl == pytest.approx(0.0786086, abs=1e-6)
    # k3 = mean(w − 1 − ln w) = (0.901388 + 0.110826 + 0 + 0.094535 + 0.636294) / 5 = 1.743043 / 5
    assert stats.k3_kl == pytest.approx(0.3486086, abs=1e-6)
    # max |Δ| = |ln 0.25| (the masked ln 7 = 1.9459 does not count)
    assert stats.abs_diff_max == pytest.approx(math.log(4.0))
    # |Δ| > 0.5: ln3, ln0.6 (0.5108), ln0.25 → 3 of 5
    assert stats.abs_diff_frac_above == pytest.approx(0.6)


def test_no_gap_gives_zero_metrics_and_unit_weights() -> None:
    corr = rollout_correction(
        OLD,
        OLD.clone(),
        MASK,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="sequence",
        rollout_rs_threshold=2.0,
        rollout_rs_threshold_lower=None,
        diff_threshold=0.1,
    )
    m = corr.metrics
    for key in ("kl", "k3_kl", "log_prob_abs_diff_max", "log_prob_abs_diff_frac_above"):
        assert m[f"rollout_corr/{key}"] == 0.0
    assert corr.weights is not None
    assert torch.equal(corr.weights, MASK)  # w = 1 on every token, 0 where masked
    assert torch.equal(corr.response_mask, MASK)  # nothing rejected
    assert m["rollout_corr/rollout_is_mean"] == 1.0
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0


def test_token_tis_truncates_each_token() -> None:
    tis = truncated_is_weights(LOG_RATIO, MASK, level="token", threshold=2.0)
    # min(w, 2): 3 → 2; the masked token → 0
    expected = torch.tensor([[2.0, 0.6, 1.0], [1.5, 0.25, 0.0]], dtype=F64)
    torch.testing.assert_close(tis.weights, expected)
    assert tis.mean == pytest.approx((3.0 + 0.6 + 1.0 + 1.5 + 0.25) / 5)  # before truncation: 1.27
    assert tis.max == pytest.approx(3.0)
    assert tis.fraction_truncated == pytest.approx(1 / 5)  # one token of five above 2
    assert not tis.weights.requires_grad


def test_sequence_tis_is_the_product_over_the_response() -> None:
    tis = truncated_is_weights(LOG_RATIO, MASK, level="sequence", threshold=2.0)
    expected = torch.tensor([[1.8, 1.8, 1.8], [0.375, 0.375, 0.0]], dtype=F64)
    torch.testing.assert_close(tis.weights, expected)
    assert tis.mean == pytest.approx((3 * 1.8 + 2 * 0.375) / 5)  # 1.23, per token
    assert tis.fraction_truncated == 0.0
    # C = 1.5: row 0 (1.8) is truncated to 1.5, one sequence of two
    tis = truncated_is_weights(LOG_RATIO, MASK, level="sequence", threshold=1.5)
    expected = torch.tensor([[1.5, 1.5, 1.5], [0.375, 0.375, 0.0]], dtype=F64)
    torch.testing.assert_close(tis.weights, expected)
    assert tis.max == pytest.approx(1.8)
    assert tis.fraction_truncated == pytest.approx(0.5)


def test_geometric_is_a_rejection_level_only() -> None:
    with pytest.raises(ValueError, match="rollout_is level must be 'token' or 'sequence'"):
        truncated_is_weights(LOG_RATIO, MASK, level="geometric", threshold=2.0)
    with pytest.raises(UnknownNameError, match="Valid names: geometric, sequence, token"):
        get_weight_level("seq")


def test_token_rejection_drops_tokens_outside_the_band() -> None:
    rs = rejection_mask(LOG_RATIO, MASK, level="token", upper=2.0)  # keep 0.5 ≤ w ≤ 2
    # row 0: 3 rejected, 0.6 and 1 kept; row 1: 1.5 kept, 0.25 rejected
    expected = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64)
    assert torch.equal(rs.response_mask, expected)
    assert rs.masked_fraction == pytest.approx(2 / 5)
    assert rs.seq_masked_fraction == 1.0  # both rows lost a token


def test_sequence_and_geometric_rejection_drop_whole_sequences() -> None:
    # sequence weights 1.8 (kept) and 0.375 (< 0.5: rejected)
    rs = rejection_mask(LOG_RATIO, MASK, level="sequence", upper=2.0)
    assert torch.equal(rs.response_mask, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64))
    assert rs.masked_fraction == pytest.approx(2 / 5)
    assert rs.seq_masked_fraction == pytest.approx(1 / 2)
    # geometric means 1.2164 and 0.6124: both inside [0.5, 2], row 1 outside [0.7, 2]
    assert torch.equal(rejection_mask(LOG_RATIO, MASK, level="geometric", upper=2.0).response_mask, MASK)
    rs = rejection_mask(LOG_RATIO, MASK, level="geometric", upper=2.0, lower=0.7)
    assert torch.equal(rs.response_mask, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64))


def test_rejection_sees_weights_beyond_the_exp_clamp() -> None:
    # a sequence log weight of −30 (w = e^−30) is below any lower bound even though exp is clamped at ±20
    log_ratio = torch.tensor([[-15.0, -15.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    rs = rejection_mask(log_ratio, mask, level="sequence", upper=2.0, lower=math.exp(-25.0))
    assert rs.response_mask.sum() == 0


# --- the weights in the policy loss ---------------------------------------------------------------------

ADV = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, -5.0]], dtype=F64)
RATIOS = torch.tensor([[1.5, 0.5, 0.5], [4.0, 1.0, 10.0]], dtype=F64)


def _loss(name: str, weights: torch.Tensor | None, mode: str = "token-mean") -> torch.Tensor:
    return get_policy_loss(name)(
        log_prob=OLD + RATIOS.log(),
        old_log_prob=OLD,
        advantages=ADV,
        response_mask=MASK,
        loss_agg_mode=mode,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        rollout_is_weights=weights,
    ).loss


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_unit_weights_change_nothing(name: str, mode: str) -> None:
    assert torch.equal(_loss(name, torch.ones(2, 3, dtype=F64), mode), _loss(name, None, mode))


def test_weights_multiply_each_token_loss() -> None:
    # vanilla per-token losses (test_policy_loss): −1.28, −0.5, 0.8 | 3 (dual clip), −2; token-mean 0.004.
    # w = 2 on the first token adds −1.28 · (2 − 1) / 5 = −0.256; w = 0 on the dual-clipped one drops 3/5
    w = torch.ones(2, 3, dtype=F64)
    w[0, 0], w[1, 0] = 2.0, 0.0
    assert _loss("vanilla", w).item() == pytest.approx(0.004 - 0.256 - 0.6, abs=1e-9)
