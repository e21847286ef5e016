"""Attention backends for packed ("remove padding") forwards, and the plans they run on.

A packed forward concatenates S sequences into one row of N tokens; attention must stay inside each
sequence (causal, block-diagonal). The backends (``PACKED_ATTENTION``; each takes ``q (N, H, D)``,
``k``/``v (N, H_kv, D)`` → ``(N, H, D)``):

- ``flash_attn``: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16, flash-attn installed);
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch ≥ 2.10, CUDA, fp16/bf16); causal is
  ``window_size=(-1, 0)``;
- ``flex``: FlexAttention with a document-causal block mask (compiled on CUDA; eager on CPU, where it
  has no backward: no-grad log-probs only);
- ``bucketed``: sequences grouped into buckets of similar length, one causal sdpa per bucket on the
  bucket's sequences right-padded to its longest (a real query never sees a padded key: padding follows
  the real tokens and the causal mask hides later positions; padded queries are dropped). Cost
  ≤ ``_PAD_SLACK``·Σ len²;
- ``padded``: the honest fallback, every sequence in one right-padded batch, one causal sdpa;

and :func:`reference_attention`, the readable one-sdpa-per-sequence reference every backend is
checked against. Backends are handed ``q``, ``k``, ``v`` in one dtype
(:func:`verl_core.models.varlen_sdpa.one_dtype`; under autocast HF's RoPE returns q and k in fp32
beside a bf16 v). All host work (``cu_seqlens`` to a Python list, bucket index tensors, the flex block
mask) happens once per forward in :func:`make_plan`, not once per layer: a packed forward makes one
host synchronisation (reading ``cu_seqlens``) whatever the depth. Which backend runs, and how models
call it: :mod:`verl_core.models.varlen_sdpa`.

Head counts come from the tensors' shapes (GQA ratio ``H / H_kv``), never from the config: under
tensor parallelism each rank holds ``H / tp`` query and ``H_kv / tp`` key/value heads.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from verl_core.registry import Registry


def take(x: Tensor, index: Tensor, dim: int = 0) -> Tensor:
    """``x`` indexed along ``dim`` by an integer ``index`` of any shape: ``x (…, M, …)``, ``index (I…)``
    → ``(…, I…, …)``, the same values as ``x[index]`` (dim 0). Used for every gather that gradients flow
    back through: the backward of ``index_select`` adds the rows in index order (``index_add_``), while
    ``x[index]``'s (``index_put_`` with accumulate) adds them in CPU-thread order, so two runs of the
    same update differ in the last bit (tests/verl_core/models/test_determinism.py)."""
    out = x.index_select(dim, index.reshape(-1))
    return out.view(*x.shape[:dim], *index.shape, *x.shape[dim + 1 :])


class Bucket(NamedTuple):
    idx: Tensor  # (G, L) token index of (sequence g, position t); padding points at the sequence's start
    keep: Tensor  # (n_real,) flat positions in (G·L) of the real tokens, in bucket order


class SharedPrompts(NamedTuple):
    """A packed stream that stores a prompt once for all the sequences that start with it (the
    samples of one prompt group): N stored tokens stand for the T = Σ len tokens of the S full
    sequences that ``cu_seqlens (S+1,)`` describes. Exact under causal attention: a prompt token attends
    only to earlier prompt tokens, so its hidden states are the same in every sequence.

    expand (T,)  stored position of each token of the full sequences
    unique (N,)  a full-sequence position of each stored token (``expand[unique[i]] == i``): whose
                 attention output the stored token takes
    """

    expand: Tensor
    unique: Tensor


class PackedPlan(NamedTuple):
    """Everything a backend needs, built once per forward from ``cu_seqlens`` (host-side).

    With shared prompts the backend attends over the T tokens of the full sequences: bucketed/padded
    fold ``expand``/``unique`` into their bucket indices (no extra copy); the others get the
    gathered ``q[expand]``… and return ``out[unique]`` (``expand``/``unique`` set here)."""

    backend: str
    cu_seqlens: Tensor  # (S+1,) int32 on the device
    max_len: int
    buckets: tuple[Bucket, ...] = ()  # bucketed / padded
    inverse: Tensor | None = None  # (N,) bucket order → packed order
    block_mask: Any = None  # flex
    expand: Tensor | None = None  # (T,) shared prompts, not folded into the buckets
    unique: Tensor | None = None  # (N,)


class Backend(NamedTuple):
    """``unavailable(device, dtype, needs_grad)`` → reason or None; ``attend(q, k, v, plan, scale,
    dropout)`` with ``q (N, H, D)``, ``k``/``v (N, H_kv, D)`` → ``(N, H, D)``."""

    unavailable: Callable[[torch.device, torch.dtype, bool], str | None]
    attend: Callable[[Tensor, Tensor, Tensor, PackedPlan, float | None, float], Tensor]


PACKED_ATTENTION: Registry[Backend] = Registry("packed attention backend")


# --------------------------------------------------------------------------------------------------
# Plans


# A bucket's padded cost (count · max_len²) may exceed the cost of its sequences one by one (Σ len²)
# by this factor before a new bucket starts.
_PAD_SLACK = 1.25


def length_buckets(lengths: list[int], slack: float = _PAD_SLACK) -> list[list[int]]:
    """Sequence indices grouped by similar length (ascending), so that padding each group to its
    longest costs at most ``slack`` × the per-sequence attention cost Σ len²."""
    buckets: list[list[int]] = []
    current: list[int] = []
    cost = 0
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        length = lengths[i]
        if current and (len(current) + 1) * length * length > slack * (cost + length * length):
            buckets.append(current)
            current, cost = [], 0
        current.append(i)
        cost += length * length
    if current:
        buckets.append(current)
    return buckets


def _bucket_plan(
    cu: list[int], slack: float, device: torch.device, shared: SharedPrompts | None = None
) -> tuple[tuple[Bucket, ...], Tensor]:
    """Index tensors of every bucket, and the inverse permutation bucket order → packed order (built
    on the host, moved to ``device`` once). With ``shared`` prompts the buckets gather from the
    stored tokens (``expand[idx]``) and the inverse picks each stored token's output (``[unique]``)."""
    expand = None if shared is None else shared.expand.cpu()
    starts_all = torch.tensor(cu[:-1], dtype=torch.long)  # (S,)
    lens_all = torch.tensor(cu[1:], dtype=torch.long) - starts_all  # (S,)
    buckets, order = [], []
    for members in length_buckets(lens_all.tolist(), slack):
        sel = torch.tensor(members, dtype=torch.long)
        starts, lens = starts_all[sel], lens_all[sel]  # (G,)
        pos = torch.arange(int(lens.max()))  # (L,)
        real = pos[None, :] < lens[:, None]  # (G, L)
        idx = torch.where(real, starts[:, None] + pos[None, :], starts[:, None])  # (G, L)
        keep = real.flatten().nonzero().squeeze(1)  # (n_b,)
        order.append(idx.flatten()[keep])
        if expand is not None:
            idx = expand[idx]  # (G, L) stored positions
        buckets.append(Bucket(idx.to(device, non_blocking=True), keep.to(device, non_blocking=True)))
    flat = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    inverse = torch.empty_like(flat)
    inverse[flat] = torch.arange(len(flat))
    if shared is not None:
        inverse = inverse[shared.unique.cpu()]  # (N,)
    return tuple(buckets), inverse.to(device, non_blocking=True)


def _flex_block_mask(cu: list[int], device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    n = cu[-1]
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(cu)], device=device)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)  # (N,)

    def document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (doc[q] == doc[kv]) & (q >= kv)

    # on CUDA the mask is built by a compiled kernel block by block (eager evaluates all N×N pairs)
    return create_block_mask(document_causal, None, None, n, n, device=device, _compile=device.type == "cuda")


def make_plan(
    backend: str, cu_seqlens: Tensor | list[int], device: torch.device, shared: SharedPrompts | None = None
) -> PackedPlan:
    """The plan of one packed forward. ``cu_seqlens (S+1,)``; read on the host once (one sync), like
    ``shared`` for the bucketed/padded backends."""
    cu = cu_seqlens if isinstance(cu_seqlens, list) else [int(x) for x in cu_seqlens.tolist()]
    max_len = max((b - a for a, b in itertools.pairwise(cu)), default=0)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device=device)
    if backend in ("bucketed", "padded"):
        slack = _PAD_SLACK if backend == "bucketed" else math.inf
        buckets, inverse = _bucket_plan(cu, slack, device, shared)
        return PackedPlan(backend, cu_dev, max_len, buckets, inverse)
    gather: dict[str, Any] = {}
    if shared is not None:
        gather = {"expand": shared.expand.to(device), "unique": shared.unique.to(device)}
    if backend == "flex":
        return PackedPlan(backend, cu_dev, max_len, block_mask=_flex_block_mask(cu, device), **gather)
    return PackedPlan(backend, cu_dev, max_len, **gather)


# --------------------------------------------------------------------------------------------------
# Backends


def _sdpa_buckets(
    q: Tensor, k: Tensor, v: Tensor, plan: PackedPlan, scale: float | None, dropout: float
) -> Tensor:
    assert plan.inverse is not None
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H, N, D)
    gqa = q.shape[1] != k.shape[1]
    pieces = []
    for b in plan.buckets:
        out = F.scaled_dot_product_attention(
            take(qh, b.idx, 1).transpose(0, 1),  # (G, H, L, D)
            take(kh, b.idx, 1).transpose(0, 1),  # (G, H_kv, L, D)
            take(vh, b.idx, 1).transpose(0, 1),
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        g, h, length, d = out.shape
        pieces.append(out.transpose(1, 2).reshape(g * length, h, d).index_select(0, b.keep))  # (n_b, H, D)
    if not pieces:
        return q.new_zeros(q.shape)
    return torch.cat(pieces).index_select(0, plan.inverse)  # (N, H, D) in packed order


def _sdpa_unavailable(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str | None:
    return None


PACKED_ATTENTION.register("bucketed")(Backend(_sdpa_unavailable, _sdpa_buckets))
PACKED_ATTENTION.register("padded")(Backend(_sdpa_unavailable, _sdpa_buckets))


def _no_dropout(name: str, dropout: float) -> None:
    if dropout:
        raise NotImplementedError(f"packed attention backend {name!r} has no attention dropout")


def _varlen_unavailable(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str | None:
    if device.type != "cuda":
        return "torch varlen_attn needs CUDA"
    try:
        import torch.nn.attention.varlen
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs ≥ 2.10)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"torch varlen_attn needs float16/bfloat16, got {dtype}"
    return None


def _varlen(q: Tensor, k: Tensor, v: Tensor, plan: PackedPlan, scale: float | None, dropout: float) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    _no_dropout("varlen", dropout)
    cu, m = plan.cu_seqlens, plan.max_len
    out = varlen_attn(
        q, k, v, cu, cu, m, m, scale=scale, window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1]
    )
    assert isinstance(out, Tensor)
    return out


PACKED_ATTENTION.register("varlen")(Backend(_varlen_unavailable, _varlen))


def _flash_unavailable(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str | None:
    if device.type != "cuda":
        return "flash-attn needs CUDA"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "flash-attn is not installed"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16/bfloat16, got {dtype}"
    return None


def _flash(q: Tensor, k: Tensor, v: Tensor, plan: PackedPlan, scale: float | None, dropout: float) -> Tensor:
    from flash_attn import flash_attn_varlen_func

    cu, m = plan.cu_seqlens, plan.max_len
    out: Tensor = flash_attn_varlen_func(
        q, k, v, cu, cu, m, m, dropout_p=dropout, softmax_scale=scale, causal=True
    )
    return out  # flash-attn handles GQA (fewer k/v heads) itself


PACKED_ATTENTION.register("flash_attn")(Backend(_flash_unavailable, _flash))


def _flex_unavailable(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str | None:
    try:
        import torch.nn.attention.flex_attention
    except ImportError:
        return f"torch {torch.__version__} has no FlexAttention"
    if device.type == "cpu" and needs_grad:
        return "FlexAttention has no backward on CPU (no-grad forwards only)"
    return None


_compiled_flex: Any = None


def _flex(q: Tensor, k: Tensor, v: Tensor, plan: PackedPlan, scale: float | None, dropout: float) -> Tensor:
    """Compiled on CUDA (the eager version materialises the N×N scores); eager elsewhere: a slow CPU
    compile is not worth it for a no-grad forward, and tests stay fast."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    _no_dropout("flex", dropout)
    fn: Any = flex_attention
    if q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    out = fn(
        q.transpose(0, 1)[None],  # (1, H, N, D)
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=plan.block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)  # (N, H, D)


PACKED_ATTENTION.register("flex")(Backend(_flex_unavailable, _flex))


def reference_attention(q: Tensor, k: Tensor, v: Tensor, cu: list[int], scale: float | None = None) -> Tensor:
    """The readable reference: one causal sdpa per sequence. ``q (N, H, D)``, ``k``/``v (N, H_kv, D)``."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for a, b in itertools.pairwise(cu):
        qs = q[a:b].transpose(0, 1)  # (H, L, D)
        ks = k[a:b].transpose(0, 1).repeat_interleave(groups, 0)  # (H, L, D)
        vs = v[a:b].transpose(0, 1).repeat_interleave(groups, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)
