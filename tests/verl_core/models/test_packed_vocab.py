"""The LM head's chunks at a large vocabulary (verl_core/models/packed.py, lm_head.py): a chunk holds
at most ``_CHUNK_LOGITS_ELEMENTS`` logits, and the chunked log-probs, entropies and gradients equal a
plain full-vocabulary ``log_softmax``: logits kept for backward, recomputed by the hand-written
backward (:class:`HeadLogProbs`), or recomputed under checkpointing where that does not apply."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from verl_core.models import packed
from verl_core.models.packed import chunked_log_probs, logits_chunk_tokens


def test_chunk_tokens_by_hand() -> None:
    budget = packed._CHUNK_LOGITS_ELEMENTS  # 64 Mi = 67,108,864 logits
    # Qwen2.5's 151,936 rows: 441 × 151,936 = 67,003,776 ≤ 67,108,864 < 442 × 151,936 = 67,155,712
    assert logits_chunk_tokens(1024, 151_936) == 441
    # the quickstart's 327 rows: 64 Mi / 327 = 205,225 tokens, so chunk_size (1024) decides
    assert logits_chunk_tokens(1024, 327) == 1024
    assert logits_chunk_tokens(1024, budget // 1024) == 1024  # the largest vocabulary left as it was
    assert logits_chunk_tokens(1024, budget + 1) == 1  # never 0 tokens


def _reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    t: float,
    cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The readable reference: the whole (N, V) log_softmax at once."""
    z = F.linear(hidden, weight, bias)
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    logp = F.log_softmax(z / t, -1)  # (N, V)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


PATHS = {  # _KEEP_LOGITS_ELEMENTS, softcap
    "kept": (10**9, None),  # small N·V: backward keeps the logits
    "hand-written backward": (0, None),  # every call recomputes: HeadLogProbs
    "checkpointed": (0, 30.0),  # soft-capping: HeadLogProbs does not apply, checkpointing does
}


@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("path", list(PATHS))
def test_chunks_stay_under_the_budget_and_equal_the_full_log_softmax(
    monkeypatch: pytest.MonkeyPatch, path: str, temperature: float, entropy_grad: bool
) -> None:
    keep, cap = PATHS[path]
    # budget 100 logits at V = 50: 2 tokens per chunk, so 13 tokens run in 7 chunks (the last of 1)
    monkeypatch.setattr(packed, "_CHUNK_LOGITS_ELEMENTS", 100)
    monkeypatch.setattr(packed, "_KEEP_LOGITS_ELEMENTS", keep)
    sizes: list[int] = []  # rows × V of every LM-head matmul
    linear = F.linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: Any = None) -> torch.Tensor:
        sizes.append(x.shape[0] * w.shape[0])
        return linear(x, w, b)

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (13,), generator=g)
    ref_lp, ref_ent = _reference(hidden, weight, bias, targets, temperature, cap)

    monkeypatch.setattr(F, "linear", spy)
    out = chunked_log_probs(
        hidden, weight, targets, bias=bias, chunk_size=1024, temperature=temperature, softcap=cap,
        entropy_grad=entropy_grad,
    )  # fmt: skip
    # forward: 6 chunks of 2 tokens × 50 and one of 1 token; logits kept for backward (all of them
    # exist at once anyway): one chunk of chunk_size (here all 13 tokens)
    assert sizes == ([650] if path == "kept" else [100] * 6 + [50])
    assert out.entropy is not None
    torch.testing.assert_close(out.log_probs, ref_lp)
    torch.testing.assert_close(out.entropy, ref_ent, atol=1e-4, rtol=1e-4)  # Σ p·log p: another formula
    assert out.entropy.requires_grad == entropy_grad
    # d/d(hidden, weight, bias) of Σ log p (+ Σ H when it carries a gradient)
    loss = out.log_probs.sum() + (out.entropy.sum() if entropy_grad else 0)
    got = torch.autograd.grad(loss, [hidden, weight, bias])
    want = torch.autograd.grad(ref_lp.sum() + (ref_ent.sum() if entropy_grad else 0), [hidden, weight, bias])
    for a, b in zip(got, want, strict=True):  # float32 sums over V of other orders: ~1e-5 apart
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if path != "kept":  # each chunk recomputed once, under the budget too
        assert len(sizes) == 14 and max(sizes) <= 100
    else:
        assert len(sizes) == 1  # never recomputed


def test_hand_written_backward_sends_no_gradient_to_inputs_that_need_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packed, "_KEEP_LOGITS_ELEMENTS", 0)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, generator=g, requires_grad=True)
    weight = torch.randn(30, 4, generator=g)  # a frozen head (LoRA): only the hidden states train
    targets = torch.randint(0, 30, (6,), generator=g)
    out = chunked_log_probs(hidden, weight, targets, chunk_size=4, with_entropy=False)
    assert out.entropy is None
    out.log_probs.sum().backward()
    ref_lp, _ = _reference(hidden, weight, None, targets, 1.0, None)
    (want,) = torch.autograd.grad(ref_lp.sum(), [hidden])
    assert hidden.grad is not None and weight.grad is None
    torch.testing.assert_close(hidden.grad, want, atol=1e-5, rtol=1e-5)
