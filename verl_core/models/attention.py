"""``varlen_sdpa``: attention for packed sequences on any device, without an N×N mask.

transformers' own packed path (``sdpa``/``eager`` with per-sequence ``position_ids``) builds a dense
block-diagonal mask over all N packed tokens, so attention costs O(N²) however short the sequences
are: on CPU that made packed training slower than padded. Flash-attn's varlen kernel avoids it but
needs a GPU. This implementation runs torch's ``scaled_dot_product_attention`` once per sequence with
``is_causal=True``: O(Σ len²), no mask at all.

It is registered with transformers as the attention implementation ``varlen_sdpa``. Called with the
flash-attn style keyword ``cu_seq_lens_q`` (what :func:`verl_core.models.packed.packed_hidden_states`
passes) it attends within each sequence; called without it (generation, padded batches) it is exactly
transformers' ``sdpa`` with its usual masks.
"""

from __future__ import annotations

import itertools
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
    bounds = cu.tolist()
    # one causal sdpa call per sequence; cat (not slice assignment, whose backward copies the whole
    # tensor once per sequence)
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            dropout_p=dropout if module.training else 0.0,
            is_causal=True,
            scale=scaling,
        )
        for a, b in itertools.pairwise(bounds)
    ]
    out = torch.cat(parts, dim=2) if parts else query.new_zeros(query.shape)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation="varlen_sdpa"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, varlen_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
