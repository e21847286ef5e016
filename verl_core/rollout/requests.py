"""From prompts to padded batches and back, shared by the rollout engines: prompts encoded to ids,
requests grouped into length-bucketed batches, left padding, the cut at a stop string, and the checks
of sampling parameters and lengths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from verl_core.errors import ConfigError
from verl_core.rollout.base import SamplingParams


def encode_prompts(tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    """Strings → ids with ``add_special_tokens=False`` (templated already); id lists pass through."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = list(tokenizer.encode(p, add_special_tokens=False))
        else:
            ids = [int(t) for t in cast("Sequence[int]", p)]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        out.append(ids)
    return out


def plan_batches(
    lengths: Sequence[int], max_new_tokens: int, max_batch_size: int, max_batch_tokens: int | None = None
) -> list[list[int]]:
    """Indices of requests grouped into generate batches, shortest prompts first.

    A batch holds at most ``max_batch_size`` rows and, when ``max_batch_tokens`` is set, at most that
    many padded tokens ``rows × (longest prompt + max_new_tokens)`` (a single row always fits)."""
    order = sorted(range(len(lengths)), key=lambda k: (lengths[k], k))
    batches: list[list[int]] = []
    current: list[int] = []
    for k in order:
        rows = len(current) + 1
        padded = rows * (lengths[k] + max_new_tokens)  # sorted: request k is the longest so far
        if current and (
            rows > max_batch_size or (max_batch_tokens is not None and padded > max_batch_tokens)
        ):
            batches.append(current)
            current = []
        current.append(k)
    if current:
        batches.append(current)
    return batches


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(input_ids (B, P), attention_mask (B, P))`` with each row right-aligned (left padding)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[b, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def cut_at_stop_string(tokenizer: Any, ids: Sequence[int], stop: Sequence[str]) -> tuple[int, str] | None:
    """The first stop-string match in the decoded response: ``(tokens to keep, text)``, or None.

    Tokens are kept up to and including the one that completes the match; the text ends right after
    the matched stop string (text decoded without special tokens)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    ends = [text.find(s) + len(s) for s in stop if s and s in text]
    if not ends:
        return None

    def matched(m: int) -> bool:
        prefix = tokenizer.decode(list(ids[:m]), skip_special_tokens=True)
        return any(s and s in prefix for s in stop)

    lo, hi = 1, len(ids)  # smallest m with matched(m): matched is monotone in m
    while lo < hi:
        mid = (lo + hi) // 2
        if matched(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo, text[: min(ends)]


def check_params(params: SamplingParams) -> None:
    """``params`` in range, each problem a :class:`ConfigError` naming its ``rollout.*`` key."""
    if params.n < 1:
        raise ConfigError(f"rollout.n: expected ≥ 1, got {params.n}")
    if params.temperature < 0:
        raise ConfigError(f"rollout.temperature: expected ≥ 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ConfigError(f"rollout.top_p: expected in (0, 1], got {params.top_p}")
    if params.max_new_tokens < 1:
        raise ConfigError(f"rollout.max_new_tokens: expected ≥ 1, got {params.max_new_tokens}")


def check_lengths(prompt_ids: list[list[int]], max_new_tokens: int, max_positions: int | None) -> None:
    """Every prompt plus ``max_new_tokens`` fits the model's ``max_positions`` (None: unbounded)."""
    if max_positions is None:
        return
    for i, ids in enumerate(prompt_ids):
        if len(ids) + max_new_tokens > max_positions:
            raise ConfigError(
                f"prompt {i}: {len(ids)} tokens + max_new_tokens {max_new_tokens} exceeds the model's "
                f"max_position_embeddings ({max_positions}); shorten the prompt or lower max_new_tokens"
            )
