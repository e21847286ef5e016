"""Packed attention under autocast (fp32 master weights, bf16 compute; issue 36 item 6): HF's RoPE hands
q and k over in fp32 beside a bf16 v; every backend must get one dtype, and the self-check must see
the inputs a model sends."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.verl_core.models.test_packed import ragged_batch, reference_log_probs, tiny
from verl_core.models import varlen_sdpa
from verl_core.models.attention import PACKED_ATTENTION, Backend, PackedPlan, reference_attention
from verl_core.models.heads import value_model_from_policy
from verl_core.models.packed import packed_log_probs, packed_scores, use_varlen_attention
from verl_core.models.varlen_sdpa import self_check

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def _recording(name: str, seen: list[tuple[torch.dtype, ...]]) -> Backend:
    """Backend ``name`` that records the dtypes of every q, k, v it is handed, then runs as itself."""
    real = PACKED_ATTENTION.get(name)

    def attend(
        q: Tensor, k: Tensor, v: Tensor, plan: PackedPlan, scale: float | None, dropout: float
    ) -> Tensor:
        seen.append((q.dtype, k.dtype, v.dtype))
        return real.attend(q, k, v, plan, scale, dropout)

    return Backend(real.unavailable, attend)


@pytest.mark.parametrize("name", ["bucketed", "padded", "flex", "varlen", "flash_attn"])
def test_bf16_autocast_packed_forward_hands_one_dtype_and_matches_eager(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = PACKED_ATTENTION.get(name).unavailable(CPU, BF16, False)
    if reason is not None:  # varlen / flash_attn: CUDA only
        pytest.skip(f"{name} on CPU: {reason}")
    grad = PACKED_ATTENTION.get(name).unavailable(CPU, BF16, True) is None  # flex: no CPU backward
    seen: list[tuple[torch.dtype, ...]] = []
    monkeypatch.setitem(PACKED_ATTENTION._entries, name, _recording(name, seen))
    monkeypatch.setattr(varlen_sdpa, "_checked", {})  # the self-check runs through the recorder too
    model = tiny("qwen2")  # fp32 parameters: the master weights
    use_varlen_attention(model)
    seqs, flat, cu = ragged_batch(lengths=[7, 1, 8, 8, 6, 3])
    with torch.autocast("cpu", BF16):
        ref_lp, _ = reference_log_probs(model, seqs)  # eager: transformers' sdpa, one sequence at a time
        with torch.set_grad_enabled(grad):
            out, has = packed_log_probs(model, flat, cu, chunk_size=4, attention=name)
    # the old code handed every layer (fp32, fp32, bf16): q and k from RoPE's fp32 tables
    assert seen, "the recording backend was never called"
    assert set(seen) == {(BF16, BF16, BF16)}
    # bf16 keeps 8 significant bits (relative rounding 2^-8 ≈ 3.9e-3); both forwards compute in bf16
    # but round in other places (packed vs one sequence, padded buckets), through 2 layers and a
    # log-softmax over 97 tokens (|log p| ≈ ln 97 ≈ 4.6): differences of a few 1e-3, bound 3e-2
    torch.testing.assert_close(out.log_probs[has], torch.cat(ref_lp), atol=3e-2, rtol=0)
    if grad:  # fp32 masters get fp32 gradients through the casts
        weight = model.model.layers[0].self_attn.q_proj.weight
        (g,) = torch.autograd.grad(out.log_probs[has].sum(), weight)
        assert g.dtype == torch.float32 and bool(g.isfinite().all()) and bool(g.abs().sum() > 0)


def test_bf16_autocast_critic_values_hand_one_dtype_and_match_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    # the critic's (and reward model's) packed forward runs the same attention: auto on CPU = bucketed
    seen: list[tuple[torch.dtype, ...]] = []
    monkeypatch.setitem(PACKED_ATTENTION._entries, "bucketed", _recording("bucketed", seen))
    monkeypatch.setattr(varlen_sdpa, "_checked", {})
    critic = value_model_from_policy(tiny("qwen2"), seed=0).eval()  # fp32 masters
    use_varlen_attention(critic)
    seqs, flat, cu = ragged_batch()
    with torch.autocast("cpu", BF16):
        values = packed_scores(critic, flat, cu, attention="bucketed")
        ref = torch.cat([critic(input_ids=s[None], use_cache=False).logits[0, :, 0].float() for s in seqs])
    assert seen and set(seen) == {(BF16, BF16, BF16)}
    # values of a fresh head are O(0.1-1); bf16 rounding (2^-8 relative) through 2 layers: bound 3e-2
    torch.testing.assert_close(values, ref, atol=3e-2, rtol=0)


def _strict_attend(
    q: Tensor, k: Tensor, v: Tensor, plan: PackedPlan, scale: float | None, dropout: float
) -> Tensor:
    """As flash-attn's varlen kernel: fp16/bf16 only, one dtype (autocast does not cast custom ops)."""
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, BF16):
        raise RuntimeError(f"expects one dtype of fp16/bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    return reference_attention(q, k, v, plan.cu_seqlens.tolist(), scale)


def test_self_check_feeds_the_mixed_dtypes_a_model_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    # a backend that refuses mixed/fp32 inputs passes the bf16 self-check through one_dtype; without
    # the cast it fails it: the check hands over fp32 q, k and a bf16 v, as a model under autocast does
    monkeypatch.setitem(PACKED_ATTENTION._entries, "strict", Backend(lambda *_: None, _strict_attend))
    monkeypatch.setattr(varlen_sdpa, "_checked", {})
    assert self_check("strict", CPU, BF16, needs_grad=True) is None
    monkeypatch.setattr(varlen_sdpa, "_checked", {})
    monkeypatch.setattr(varlen_sdpa, "one_dtype", lambda q, k, v: (q, k, v))
    reason = self_check("strict", CPU, BF16, needs_grad=True)
    assert reason is not None and "float32, float32, bfloat16" in reason.replace("torch.", "")
