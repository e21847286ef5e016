"""The LM head's chunks at a large vocabulary (verl_core/models/packed.py): a chunk holds at most
``_CHUNK_LOGITS_ELEMENTS`` logits, and the chunked log-probs, entropies and gradients equal a plain
full-vocabulary ``log_softmax``, with and without recomputation in backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from verl_core.models import packed
from verl_core.models.packed import chunked_log_probs, logits_chunk_tokens


def test_chunk_tokens_by_hand() -> None:
    budget = packed._CHUNK_LOGITS_ELEMENTS  # 16 Mi = 16,777,216 logits
    # Qwen2.5's 151,936 rows: 110 × 151,936 = 16,712,960 ≤ 16,777,216 < 111 × 151,936 = 16,864,896
    assert logits_chunk_tokens(1024, 151_936) == 110
    # the quickstart's 327 rows: 16 Mi / 327 = 51,306 tokens, so chunk_size (1024) decides
    assert logits_chunk_tokens(1024, 327) == 1024
    assert logits_chunk_tokens(1024, budget // 1024) == 1024  # the largest vocabulary left as it was
    assert logits_chunk_tokens(1024, budget + 1) == 1  # never 0 tokens


def _reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, t: float) -> tuple:
    """The readable reference: the whole (N, V) log_softmax at once."""
    logp = F.log_softmax(hidden @ weight.T / t, -1)  # (N, V)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunks_stay_under_the_budget_and_equal_the_full_log_softmax(
    monkeypatch: pytest.MonkeyPatch, recompute: bool, temperature: float
) -> None:
    # budget 100 logits at V = 50: 2 tokens per chunk, so 13 tokens run in 7 chunks (the last of 1)
    monkeypatch.setattr(packed, "_CHUNK_LOGITS_ELEMENTS", 100)
    # recompute: every chunk is checkpointed (any N·V is above a threshold of 0)
    monkeypatch.setattr(packed, "_KEEP_LOGITS_ELEMENTS", 0 if recompute else 10**9)
    sizes: list[int] = []
    real = packed._chunk_logprobs

    def spy(hidden: torch.Tensor, weight: torch.Tensor, *args: Any) -> Any:
        sizes.append(hidden.shape[0] * weight.shape[0])
        return real(hidden, weight, *args)

    monkeypatch.setattr(packed, "_chunk_logprobs", spy)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (13,), generator=g)

    out = chunked_log_probs(hidden, weight, targets, chunk_size=1024, temperature=temperature)
    assert sizes == [100] * 6 + [50]  # forward: 6 chunks of 2 tokens × 50, one of 1 token
    ref_lp, ref_ent = _reference(hidden, weight, targets, temperature)
    assert out.entropy is not None
    torch.testing.assert_close(out.log_probs, ref_lp)
    torch.testing.assert_close(out.entropy, ref_ent)
    # d/d(hidden, weight) of Σ log p + Σ H, through the chunks (recomputed or kept) and the reference
    got = torch.autograd.grad(out.log_probs.sum() + out.entropy.sum(), [hidden, weight])
    want = torch.autograd.grad(ref_lp.sum() + ref_ent.sum(), [hidden, weight])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert max(sizes) <= 100  # backward's recomputed chunks too
    assert len(sizes) == (14 if recompute else 7)  # each chunk recomputed once, or never
