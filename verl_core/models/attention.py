"""``varlen_sdpa``: attention for packed sequences on any device, without an N×N mask.

transformers' own packed path (``sdpa``/``eager`` with per-sequence ``position_ids``) builds a dense
block-diagonal mask over all N packed tokens, so attention costs O(N²) however short the sequences
are: on CPU that made packed training slower than padded. Flash-attn's varlen kernel avoids it but
needs a GPU. This implementation groups the sequences into buckets of similar length and runs torch's
``scaled_dot_product_attention`` once per bucket on the bucket's sequences right-padded to its longest,
with ``is_causal=True`` and no mask: a real query never sees a padded key (padding only ever follows
the real tokens, and the causal mask hides later positions), and padded queries are dropped. Cost
O(Σ_buckets count·max_len²) ≤ ``_PAD_SLACK``·O(Σ len²); a few kernel calls instead of one per sequence
(RL batches hold hundreds of short sequences).

It is registered with transformers as the attention implementation ``varlen_sdpa``. Called with the
flash-attn style keyword ``cu_seq_lens_q`` (what :func:`verl_core.models.packed.packed_hidden_states`
passes) it attends within each sequence; called without it (generation, padded batches) it is exactly
transformers' ``sdpa`` with its usual masks.

Head counts come from the tensors' shapes (the GQA ratio is ``H / H_kv``), never from the config: under
tensor parallelism each rank holds ``H / tp`` query and ``H_kv / tp`` key/value heads and the same code
runs on its local heads (transformers' attention reshapes by ``-1`` heads as well).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NAME = "varlen_sdpa"


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
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1, got {query.shape[0]}")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("varlen_sdpa does not implement sliding-window attention; use sdpa")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # GQA: repeat key/value heads (B, H_kv, N, D) → (B, H, N, D)
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q, k, v = query[0], key[0], value[0]  # (H, N, D)
    n = q.shape[1]
    starts_all = cu[:-1].to(device=q.device, dtype=torch.long)
    lens_all = (cu[1:] - cu[:-1]).to(device=q.device, dtype=torch.long)
    pieces: list[Tensor] = []
    where: list[Tensor] = []
    for bucket in length_buckets(lens_all.tolist()):
        sel = torch.tensor(bucket, device=q.device)
        starts, lens = starts_all[sel], lens_all[sel]  # (G,)
        pos = torch.arange(int(lens.max()), device=q.device)  # (L,)
        real = pos[None, :] < lens[:, None]  # (G, L)
        # token index of (sequence g, position t); padding points at the sequence's first token
        idx = torch.where(real, starts[:, None] + pos[None, :], starts[:, None])  # (G, L)
        out = F.scaled_dot_product_attention(
            q[:, idx].transpose(0, 1),  # (G, H, L, D)
            k[:, idx].transpose(0, 1),
            v[:, idx].transpose(0, 1),
            dropout_p=dropout if module.training else 0.0,
            is_causal=True,
            scale=scaling,
        )
        pieces.append(out.transpose(1, 2)[real])  # (real tokens, H, D)
        where.append(idx[real])
    if not pieces:
        return query.new_zeros(query.shape).transpose(1, 2).contiguous(), None
    flat = torch.cat(pieces)  # (N, H, D) in bucket order
    order = torch.cat(where)
    out = flat.new_empty((n, *flat.shape[1:])).index_copy(0, order, flat)  # back to packed order
    return out.unsqueeze(0), None


# A bucket's padded cost (count · max_len²) may exceed the cost of its sequences one by one (Σ len²)
# by this factor before a new bucket starts.
_PAD_SLACK = 1.25


def length_buckets(lengths: list[int]) -> list[list[int]]:
    """Sequence indices grouped by similar length (ascending), so that padding each group to its
    longest costs at most ``_PAD_SLACK`` × the per-sequence attention cost Σ len²."""
    buckets: list[list[int]] = []
    current: list[int] = []
    cost = 0
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        length = lengths[i]
        if current and (len(current) + 1) * length * length > _PAD_SLACK * (cost + length * length):
            buckets.append(current)
            current, cost = [], 0
        current.append(i)
        cost += length * length
    if current:
        buckets.append(current)
    return buckets


def register() -> None:
    """Make ``attn_implementation="varlen_sdpa"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, varlen_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
