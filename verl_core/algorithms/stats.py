"""Masked statistics and packed <-> padded conversion.

Every function in ``verl_core.algorithms`` works on padded ``(B, T)`` tensors with a mask
(1 = valid token, 0 = padding or a token that does not count). Packed data, all sequences concatenated
into ``(N,)`` with int32 offsets ``cu_seqlens (S+1,)`` (``cu_seqlens[0] == 0``,
``cu_seqlens[-1] == N``), is brought to that form with :func:`pad_packed` and back with
:func:`pack_padded`::

    padded = pad_packed(log_probs, cu_seqlens)           # (S, T_max) + mask
    ...compute on padded.values with padded.mask...
    per_token = pack_padded(result, padded.mask)         # (N,)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set.

    Args:
        values: ``(B, T)`` (any shape).
        mask: same shape as ``values``; bool or 0/1 float.
        dim: reduce this dimension only; ``None`` reduces everything to a scalar.
    """
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set; 0 where nothing is set.

    mean = Σ m·x / Σ m

    Args:
        values: ``(B, T)`` (any shape).
        mask: same shape as ``values``.
        dim: reduce this dimension only (e.g. ``-1`` gives a per-sequence mean ``(B,)``).
    """
    count = masked_sum(torch.ones_like(values), mask, dim)
    return masked_sum(values, mask, dim) / count.clamp_min(1e-8)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``values`` over the positions where ``mask`` is set (a scalar).

    var = Σ m·(x − mean)² / n, times n / (n − 1) if ``unbiased`` (Bessel's correction, only when n > 1;
    a single value has variance 0).

    Args:
        values: ``(B, T)`` (any shape).
        mask: same shape as ``values``.
        unbiased: apply Bessel's correction, as ``torch.var`` does by default.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if not unbiased:
        return var
    n = masked_sum(torch.ones_like(values), mask)
    bessel = torch.where(n > 1, n / (n - 1).clamp_min(1e-8), torch.ones_like(n))
    return var * bessel


def masked_whiten(
    values: Tensor, mask: Tensor, keep_mean: bool = False, unbiased: bool = True, eps: float = 1e-8
) -> Tensor:
    """Normalise ``values`` to unit variance over the masked positions.

    x̂ = (x − mean) / sqrt(var + eps), then + mean again if ``keep_mean``. Mean and variance are
    taken over the whole masked batch (one scalar each), as for PPO advantage whitening.

    Args:
        values: ``(B, T)``.
        mask: ``(B, T)``.
        keep_mean: ``False`` (the usual): the result has mean 0. ``True``: the result keeps the
            original mean and only the spread is rescaled.
        unbiased: use the unbiased variance (verl's default).
        eps: added to the variance.

    Returns:
        ``(B, T)``, 0 where ``mask`` is 0.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=unbiased)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if keep_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


class PaddedBatch(NamedTuple):
    """Right-padded sequences.

    Attributes:
        values: ``(S, T_max)``; padding holds ``pad_value``.
        mask: ``(S, T_max)`` bool, True on the first ``len_i`` positions of row ``i``.
    """

    values: Tensor
    mask: Tensor


def seq_lengths(cu_seqlens: Tensor) -> Tensor:
    """Per-sequence lengths ``(S,)`` from offsets ``cu_seqlens (S+1,)``."""
    return cu_seqlens[1:] - cu_seqlens[:-1]


def cu_seqlens_from_mask(mask: Tensor) -> Tensor:
    """Offsets ``(S+1,)`` int32 of the packed form of a right-padded batch with ``mask (S, T)``."""
    lengths = mask.to(torch.int64).sum(dim=-1)  # (S,)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=mask.device)
    cu[1:] = torch.cumsum(lengths, dim=0)
    return cu.to(torch.int32)


def pad_packed(values: Tensor, cu_seqlens: Tensor, pad_value: float = 0.0) -> PaddedBatch:
    """Unpack ``values (N,)`` into right-padded rows ``(S, T_max)`` with a mask.

    Row ``i`` holds ``values[cu_seqlens[i]:cu_seqlens[i+1]]`` then ``pad_value``;
    ``T_max = max_i len_i``.

    Args:
        values: ``(N,)`` packed sequences (any dtype).
        cu_seqlens: ``(S+1,)`` int offsets, non-decreasing, ``cu_seqlens[-1] == N``.
        pad_value: filler for positions past a sequence's end.
    """
    lengths = seq_lengths(cu_seqlens.to(torch.int64))  # (S,)
    if int(cu_seqlens[-1]) != values.shape[0]:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but values has {values.shape[0]} items")
    t_max = int(lengths.max()) if lengths.numel() > 0 else 0
    positions = torch.arange(t_max, device=values.device)  # (T_max,)
    mask = positions[None, :] < lengths[:, None].to(values.device)  # (S, T_max)
    padded = torch.full((lengths.numel(), t_max), pad_value, dtype=values.dtype, device=values.device)
    # Boolean indexing walks rows in order, so the i-th True slot receives the i-th packed value.
    padded[mask] = values
    return PaddedBatch(values=padded, mask=mask)


def pack_padded(values: Tensor, mask: Tensor) -> Tensor:
    """Concatenate the masked positions of ``values (S, T)`` row by row into ``(N,)``.

    Inverse of :func:`pad_packed` for right-padded masks; the offsets are
    :func:`cu_seqlens_from_mask` of ``mask``.
    """
    return values[mask.to(torch.bool)]
