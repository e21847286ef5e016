"""Masked statistics and the packed <-> padded helpers."""

import pytest
import torch

from verl_core.algorithms import (
    cu_seqlens_from_mask,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    pack_padded,
    pad_packed,
)

VALUES = torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_sum_and_mean() -> None:
    # valid values 1, 2, 4: sum 7, mean 7/3; per row: (1+2)/2 = 1.5 and 4/1 = 4.
    assert masked_sum(VALUES, MASK).item() == pytest.approx(7.0)
    assert masked_mean(VALUES, MASK).item() == pytest.approx(7 / 3)
    torch.testing.assert_close(
        masked_mean(VALUES, MASK, dim=-1), torch.tensor([1.5, 4.0], dtype=torch.float64)
    )


def test_masked_mean_of_empty_mask_is_zero() -> None:
    assert masked_mean(VALUES, torch.zeros_like(MASK)).item() == 0.0


def test_masked_var_biased_and_unbiased() -> None:
    # 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9.
    # biased 42/9 / 3 = 14/9 ≈ 1.555556; unbiased 42/9 / 2 = 7/3 ≈ 2.333333.
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(14 / 9)
    assert masked_var(VALUES, MASK, unbiased=True).item() == pytest.approx(7 / 3)


def test_masked_var_of_single_value_is_zero() -> None:
    one = torch.tensor([[1, 0, 0], [0, 0, 0]])
    assert masked_var(VALUES, one, unbiased=True).item() == 0.0


def test_masked_whiten() -> None:
    # mean 7/3, unbiased std sqrt(7/3) = 1.527525:
    # (1 − 7/3)/1.527525 = −0.872872, (2 − 7/3)/1.527525 = −0.218218, (4 − 7/3)/1.527525 = 1.091089.
    expected = torch.tensor([[-0.872872, -0.218218, 0.0], [1.091089, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(masked_whiten(VALUES, MASK), expected, atol=1e-6, rtol=0)
    # keep_mean=True adds 7/3 back on the valid positions: 1.460461, 2.115115, 3.424423.
    expected_keep = torch.tensor([[1.460461, 2.115115, 0.0], [3.424423, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(masked_whiten(VALUES, MASK, keep_mean=True), expected_keep, atol=1e-6, rtol=0)


def test_pad_packed_hand_example() -> None:
    # Three sequences of lengths 2, 0, 4.
    packed = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    cu_seqlens = torch.tensor([0, 2, 2, 6], dtype=torch.int32)
    padded = pad_packed(packed, cu_seqlens, pad_value=-1.0)
    torch.testing.assert_close(
        padded.values, torch.tensor([[1.0, 2.0, -1.0, -1.0], [-1.0] * 4, [3.0, 4.0, 5.0, 6.0]])
    )
    assert padded.mask.tolist() == [[True, True, False, False], [False] * 4, [True] * 4]
    torch.testing.assert_close(pack_padded(padded.values, padded.mask), packed)
    assert cu_seqlens_from_mask(padded.mask).tolist() == [0, 2, 2, 6]
    assert cu_seqlens_from_mask(padded.mask).dtype == torch.int32


def test_pack_pad_round_trip_random() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (6,), generator=gen)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    packed = torch.randn(int(lengths.sum()), generator=gen)
    padded = pad_packed(packed, cu_seqlens)
    assert padded.values.shape == (6, int(lengths.max()))
    torch.testing.assert_close(pack_padded(padded.values, padded.mask), packed)
    torch.testing.assert_close(cu_seqlens_from_mask(padded.mask), cu_seqlens)
    # And the other way: a right-padded batch survives pack -> pad (padding becomes 0).
    again = pad_packed(pack_padded(padded.values, padded.mask), cu_seqlens_from_mask(padded.mask))
    torch.testing.assert_close(again.values, padded.values)


def test_masked_stats_agree_on_packed_and_padded() -> None:
    gen = torch.Generator().manual_seed(1)
    cu_seqlens = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    packed = torch.randn(9, generator=gen, dtype=torch.float64)
    padded = pad_packed(packed, cu_seqlens)
    assert masked_mean(padded.values, padded.mask).item() == pytest.approx(packed.mean().item())
    assert masked_var(padded.values, padded.mask).item() == pytest.approx(packed.var().item())
    whitened = pack_padded(masked_whiten(padded.values, padded.mask), padded.mask)
    torch.testing.assert_close(whitened, (packed - packed.mean()) / (packed.var() + 1e-8).sqrt())


def test_pad_packed_rejects_wrong_offsets() -> None:
    with pytest.raises(ValueError, match="cu_seqlens ends at 5"):
        pad_packed(torch.zeros(6), torch.tensor([0, 5], dtype=torch.int32))
