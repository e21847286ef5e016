"""``varlen_sdpa``: the attention implementation packed models run with, and the choice of its backend.

transformers' own packed path builds a dense N×N mask (O(N²)), so packed models here run with the
attention implementation ``varlen_sdpa`` registered below: called with a :class:`PackedLayout`
(keyword ``packed_layout``, what :func:`verl_core.models.packed.varlen_kwargs` passes) it runs the
layout's backend (:mod:`verl_core.models.attention`); called without one (generation, padded batches)
it is exactly transformers' ``sdpa`` with its usual masks.

``model.packed_attention`` (a backend of :data:`~verl_core.models.attention.PACKED_ATTENTION`, or
``auto``) governs packed training and log-prob/score forwards only; ``model.attn_implementation``
governs everything else (generation, HF's own padded forwards). Kept apart because the best kernels
differ (packed: varlen kernels without masks; generation: KV-cache kernels with padding masks) and
flash-attn is optional. With ``attn_implementation=flash_attention_2`` transformers' own varlen path is
used for packed forwards too and ``packed_attention`` is not consulted; with ``eager`` packed forwards
use transformers' dense mask.

``auto`` walks :data:`AUTO_ORDER` for the device and takes the first backend that is available and
passes :func:`self_check` (vs. :func:`~verl_core.models.attention.reference_attention`; run once per
(device, dtype, backend, grad) and cached); every skip and the choice are logged once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from verl_core.models.attention import (
    PACKED_ATTENTION,
    PackedPlan,
    SharedPrompts,
    make_plan,
    reference_attention,
    take,
)

NAME = "varlen_sdpa"
log = logging.getLogger(__name__)

# `auto`: first backend that is available and passes its self-check, per device type. CUDA: varlen
# kernels first (flash-attn's, then torch's wrapper of it: no compile, no block mask), then compiled
# flex, then the sdpa buckets; CPU: the sdpa buckets (eager flex materialises the N×N scores and has
# no CPU backward). Measurements behind the order: benchmarks/RESULTS.md.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash_attn", "varlen", "flex", "bucketed", "padded"),
    "cpu": ("bucketed", "padded"),
}
_FALLBACK_ORDER = ("bucketed", "padded")


class PackedLayout:
    """The sequence layout of one packed forward (a host copy of ``cu_seqlens``), handed to every
    layer as the keyword ``packed_layout``. The backend and its plan are chosen on the first layer's
    call, where the device, compute dtype (:func:`compute_dtype`: autocast / FSDP2 mixed precision may
    compute in another dtype than the parameters are stored in) and grad mode are known, and reused by
    every later layer and by activation-checkpoint recomputation."""

    def __init__(self, cu_seqlens: list[int], requested: str, shared: SharedPrompts | None = None) -> None:
        self.cu_seqlens = cu_seqlens
        self.requested = requested
        self.shared = shared
        self._plans: dict[tuple[torch.device, torch.dtype], PackedPlan] = {}

    def plan(self, query: Tensor) -> PackedPlan:
        """The plan for ``query (N, H, D)``, already in the compute dtype (:func:`one_dtype`)."""
        key = (query.device, query.dtype)
        if key not in self._plans:
            needs_grad = torch.is_grad_enabled() and query.requires_grad
            backend = select_backend(self.requested, query.device, query.dtype, needs_grad)
            self._plans[key] = make_plan(backend, self.cu_seqlens, query.device, self.shared)
        return self._plans[key]


# --------------------------------------------------------------------------------------------------
# Selection: availability, reference self-check, `auto`


_SELF_CHECK_CU = [0, 37, 38, 168, 177]  # lengths 37, 1, 130 (crosses a 128-token flex block), 9
_checked: dict[tuple[str, str, torch.dtype, bool], str | None] = {}


def compute_dtype(query: Tensor, value: Tensor) -> torch.dtype:
    """The one dtype attention computes in: autocast's lower precision when autocast is on for the
    query's device, else ``value``'s (the projections' dtype, which the output projection expects).

    Under autocast (fp32 master weights, bf16 compute) the inputs differ: ``value`` leaves its
    projection in bf16, while HF's RoPE multiplies ``query`` and ``key`` by cos/sin tables in the
    residual stream's dtype (fp32), and a plain ``mul`` promotes them to fp32. flash-attn's and torch's
    varlen kernels are custom ops that autocast does not cast (they refuse fp32), and FlexAttention
    refuses mixed dtypes."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else value.dtype


def one_dtype(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q``, ``k``, ``v`` cast to :func:`compute_dtype` (no copy where already there); every backend
    gets its inputs through this. The backends return that dtype: under autocast the same as
    transformers' sdpa (autocast runs it in the low dtype), without it ``v``'s."""
    dtype = compute_dtype(q, v)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def self_check(name: str, device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str | None:
    """None if backend ``name`` matches :func:`reference_attention` (outputs, and input grads when
    ``needs_grad``) on a tiny ragged GQA batch on ``device``/``dtype``; else the reason. Cached.

    A low-precision ``dtype`` is checked as a model under autocast calls it: q and k in fp32, v in
    ``dtype``, inside ``torch.autocast(device, dtype)``, through :func:`one_dtype`."""
    key = (name, str(device), dtype, needs_grad)
    if key in _checked:
        return _checked[key]
    reason = PACKED_ATTENTION.get(name).unavailable(device, dtype, needs_grad)
    if reason is None:
        # an fp32 reference, and the backend under this check's own autocast only: a caller's autocast
        # must not recast them; identity saved-tensor hooks: the first call may come from inside an
        # activation-checkpointed layer, whose own hooks would take this check's tensors
        identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with torch.autocast("cpu", enabled=False), torch.autocast(device.type, enabled=False), identity:
            reason = _compare_to_reference(name, device, dtype, needs_grad)
    _checked[key] = reason
    return reason


def _compare_to_reference(
    name: str, device: torch.device, dtype: torch.dtype, needs_grad: bool
) -> str | None:
    g = torch.Generator().manual_seed(0)
    n = _SELF_CHECK_CU[-1]
    q, k, v = (torch.randn(n, h, 16, generator=g) for h in (4, 2, 2))  # GQA 4/2 heads, d 16
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    ref_in = [t.clone().requires_grad_(needs_grad) for t in (q, k, v)]
    ref = reference_attention(ref_in[0], ref_in[1], ref_in[2], _SELF_CHECK_CU)
    low = dtype in (torch.float16, torch.bfloat16)
    # as under autocast: q and k fp32 (RoPE's tables), v in the compute dtype (its projection)
    given = (torch.float32, torch.float32, dtype) if low else (dtype,) * 3
    got_in = [t.to(device, d).requires_grad_(needs_grad) for t, d in zip((q, k, v), given, strict=True)]
    try:
        plan = make_plan(name, _SELF_CHECK_CU, device)
        with torch.set_grad_enabled(needs_grad), torch.autocast(device.type, dtype, enabled=low):
            got = PACKED_ATTENTION.get(name).attend(*one_dtype(*got_in), plan, None, 0.0)
        pairs = [(got.float().cpu(), ref.detach())]
        if needs_grad:
            w = torch.randn(ref.shape, generator=g)
            ref_grads = torch.autograd.grad((ref * w).sum(), ref_in)
            got_grads = torch.autograd.grad((got.float() * w.to(device)).sum(), got_in)
            pairs += [(a.float().cpu(), b) for a, b in zip(got_grads, ref_grads, strict=True)]
    except Exception as e:  # any failure disqualifies the backend on this device
        return f"self-check raised {type(e).__name__}: {e}"
    worst = max(float((a.detach() - b).abs().max()) for a, b in pairs)
    return None if worst <= tol else f"self-check max |Δ| {worst:.2e} > {tol:.0e} vs per-sequence sdpa"


_logged: set[tuple[str, str, torch.dtype, bool]] = set()


def select_backend(requested: str, device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str:
    """The backend to run: ``requested`` itself (raising with the reason when it cannot run here), or
    for ``auto`` the first of :data:`AUTO_ORDER` that can; the outcome is logged once per key."""
    key = (requested, str(device), dtype, needs_grad)
    if requested != "auto":
        reason = self_check(requested, device, dtype, needs_grad)
        if reason is not None:
            raise RuntimeError(
                f"model.packed_attention={requested!r} cannot run on {device}/{dtype}: {reason}"
            )
        return requested
    skipped: list[str] = []
    for name in AUTO_ORDER.get(device.type, _FALLBACK_ORDER):
        reason = self_check(name, device, dtype, needs_grad)
        if reason is None:
            if key not in _logged:
                _logged.add(key)
                why = "; ".join(skipped) or "first in the table"
                log.info("packed attention on %s/%s (grad=%s): %s (%s)", device, dtype, needs_grad, name, why)
            return name
        skipped.append(f"{name}: {reason}")
    raise RuntimeError(
        f"no packed attention backend passed its check on {device}/{dtype}: {'; '.join(skipped)}"
    )


# --------------------------------------------------------------------------------------------------
# The transformers attention function


def varlen_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """query ``(1, H, N, D)``, key/value ``(1, H_kv, N, D)`` → output ``(1, N, H, D)``."""
    layout: PackedLayout | None = kwargs.get("packed_layout")
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1, got {query.shape[0]}")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("packed attention does not implement sliding-window attention; use sdpa")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # (N, H, D)
    out = _packed_attention(q, k, v, layout, scaling, dropout if module.training else 0.0)
    return out.unsqueeze(0), None


@torch.compiler.disable
def _packed_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: PackedLayout, scale: float | None, dropout: float
) -> Tensor:
    """``q (N, H, D)``, ``k``/``v (N, H_kv, D)`` → ``(N, H, D)`` by the layout's backend. Never traced by
    ``torch.compile`` (a compiled decoder layer breaks its graph here): the plan reads sequence
    lengths on the host, which would otherwise recompile for every new set of lengths. With shared
    prompts the backend sees the full sequences (T tokens) and each stored token keeps its own output.
    The output is in :func:`compute_dtype`."""
    q, k, v = one_dtype(q, k, v)
    plan = layout.plan(q)
    if plan.expand is not None:
        q, k, v = take(q, plan.expand), take(k, plan.expand), take(v, plan.expand)  # (T, ·, D)
    out = PACKED_ATTENTION.get(plan.backend).attend(q, k, v, plan, scale, dropout)
    return out if plan.unique is None else take(out, plan.unique)  # (N, H, D)


def register() -> None:
    """Make ``attn_implementation="varlen_sdpa"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, varlen_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
