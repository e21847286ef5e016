"""Non-negative least squares: the solver :func:`verl_core.planning.cost.fit_calibration` fits the cost
model's coefficients with (a cost per unit is never negative)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def nnls(a: Tensor, b: Tensor, max_iter: int = 200) -> Tensor:
    """``argmin ‖a·x − b‖₂`` subject to ``x ≥ 0`` (Lawson & Hanson 1974, active set). ``a``: ``(m, n)``,
    ``b``: ``(m,)``; returns ``(n,)``. Columns are scaled to unit norm for the solve (features span
    many decades), zero columns stay 0."""
    norms = a.norm(dim=0)
    scale = torch.where(norms > 0, norms, torch.ones_like(norms))
    a = a / scale
    n = a.shape[1]
    x = torch.zeros(n, dtype=a.dtype)
    passive = torch.zeros(n, dtype=torch.bool)
    usable = norms > 0
    for _ in range(max_iter):
        grad = a.T @ (b - a @ x)
        candidates = (~passive) & usable & (grad > 1e-12)
        if not candidates.any():
            break
        passive[int(torch.where(candidates, grad, torch.full_like(grad, -math.inf)).argmax())] = True
        while True:
            z = torch.zeros(n, dtype=a.dtype)
            idx = passive.nonzero().flatten()
            z[idx] = torch.linalg.lstsq(a[:, idx], b.unsqueeze(1)).solution.flatten()
            if (z[idx] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = torch.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x / scale
