"""Log-probs and entropies of a large LM head with a hand-written, chunked backward.

At a real vocabulary (Qwen2.5: V = 151,936) the head's float32 logits are 600 KB per token, so
:func:`verl_core.models.packed.chunked_log_probs` computes them a chunk of C tokens at a time. Under
autograd, activation checkpointing of each chunk (the generic way to not keep them) makes every
chunk's backward produce its own ``(V, H)`` weight gradient (545 MB at 0.5B), allocated, added into
the weight's gradient and freed, once per chunk. :class:`HeadLogProbs` instead keeps ``log Z`` and
the entropy ``(N,)`` from the forward and, in backward, recomputes each chunk's logits ``z (C, V)``
and accumulates into one weight gradient in place:

    p = softmax(z)                                     (C, V), z = (h·Wᵀ + b) / T
    ∂ log p_y / ∂z = onehot(y) − p
    ∂ H / ∂z = −p ⊙ (z − E_p[z]),   E_p[z] = log Z − H  (H = log Z − Σ_v p_v z_v)
    g_z = g_lp · (onehot(y) − p) + g_H · ∂H/∂z,  then / T
    ∂L/∂h = g_z · W,  ∂L/∂W += g_zᵀ · h,  ∂L/∂b += Σ_rows g_z

The forward's values are those of the checkpointed chunks (the same operations on the same chunks);
gradients equal autograd's to float rounding. Float32 math throughout: the head, its inputs and its
weight in one dtype, no autocast, no logit soft-capping (callers fall back to checkpointing there).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """``z = (h·Wᵀ + b) / T`` as float32 ``(C, V)`` (no copy for T = 1)."""
    z = F.linear(h, weight, bias).float()
    return z if temperature == 1.0 else z / temperature


class HeadLogProbs(torch.autograd.Function):
    """``(hidden (N, H), weight (V, H), bias (V,) | None, targets (N,), chunk, temperature,
    with_entropy, entropy_grad)`` → ``(log p(targets) (N,), entropy (N,) or an empty tensor)``; the
    entropy carries a gradient only with ``entropy_grad``."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        chunk: int,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        log_z = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if with_entropy else log_probs.new_empty(0)
        for s in range(0, n, chunk):
            z = _logits(hidden[s : s + chunk], weight, bias, temperature)  # (C, V)
            lz = torch.logsumexp(z, dim=-1)  # (C,)
            log_probs[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - lz
            if with_entropy:
                entropy[s : s + chunk] = lz - (torch.exp(z - lz[:, None]) * z).sum(-1)
            log_z[s : s + chunk] = lz
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy)
        ctx.chunk, ctx.temperature, ctx.entropy_grad = chunk, temperature, with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor, g_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        g_h = g_ent if ctx.entropy_grad else None  # (N,) or None: no gradient through the entropy
        chunk = ctx.chunk
        for s in range(0, hidden.shape[0], chunk):
            h, lz = hidden[s : s + chunk], log_z[s : s + chunk]
            z = _logits(h, weight, bias, ctx.temperature)  # (C, V), recomputed
            g_z = torch.exp(z - lz[:, None])  # p (C, V)
            if g_h is not None:  # g_H · (−p ⊙ (z − E_p[z])), E_p[z] = log Z − H
                mean_z = lz - entropy[s : s + chunk]
                g_z = (
                    g_z * (z - mean_z[:, None]) * (-g_h[s : s + chunk, None])
                    - g_z * g_lp[s : s + chunk, None]
                )
            else:
                g_z.mul_(-g_lp[s : s + chunk, None])  # −g_lp · p
            del z
            g_z.scatter_add_(1, targets[s : s + chunk, None], g_lp[s : s + chunk, None])  # + g_lp · onehot(y)
            if ctx.temperature != 1.0:
                g_z.div_(ctx.temperature)
            g_z = g_z.to(hidden.dtype)
            if grad_h is not None:
                grad_h[s : s + chunk] = g_z @ weight
            if grad_w is not None:
                grad_w.addmm_(g_z.T, h)
            if grad_b is not None:
                grad_b += g_z.sum(0)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def head_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None,
    chunk: int,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """:class:`HeadLogProbs` applied: ``(log p(targets) (N,), entropy (N,) | None)``."""
    lp, ent = HeadLogProbs.apply(
        hidden, weight, bias, targets, chunk, temperature, with_entropy, entropy_grad
    )
    return lp, ent if with_entropy else None


def fits(hidden: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None) -> bool:
    """Whether :class:`HeadLogProbs` computes what autograd would: one floating dtype for the inputs,
    weight and bias, no autocast on their device, no soft-capping."""
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    return softcap is None and len(dtypes) == 1 and not torch.is_autocast_enabled(hidden.device.type)
