"""Packed attention backends vs. the per-sequence reference, the bucket plan by hand, and `auto`."""

from __future__ import annotations

import pytest
import torch

from tests.verl_core.models.test_packed import ragged_batch, reference_log_probs, tiny
from verl_core.models import attention as att
from verl_core.models import varlen_sdpa
from verl_core.models.attention import PACKED_ATTENTION, Backend, make_plan, reference_attention
from verl_core.models.packed import chunked_log_probs, packed_log_probs, use_varlen_attention
from verl_core.models.varlen_sdpa import select_backend

CPU = torch.device("cpu")
CU = [0, 5, 6, 15, 18, 150]  # lengths 5, 1, 9, 3, 132 (the last crosses a 128-token flex block)


def _skip_reason(name: str, grad: bool) -> str | None:
    return PACKED_ATTENTION.get(name).unavailable(CPU, torch.float32, grad)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("name", ["bucketed", "padded", "flex", "varlen", "flash_attn"])
def test_backend_equals_per_sequence_sdpa(name: str, grad: bool) -> None:
    reason = _skip_reason(name, grad)
    if reason is not None:  # flash_attn / varlen: CUDA only; flex: no CPU backward
        pytest.skip(f"{name} on CPU: {reason}")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(CU[-1], h, 8, generator=g, requires_grad=grad) for h in (4, 2, 2))  # GQA
    ref = reference_attention(q, k, v, CU)
    with torch.set_grad_enabled(grad):
        got = PACKED_ATTENTION.get(name).attend(q, k, v, make_plan(name, CU, CPU), None, 0.0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if grad:
        w = torch.randn(ref.shape, generator=g)
        for a, b in zip(
            torch.autograd.grad((got * w).sum(), [q, k, v]),
            torch.autograd.grad((ref * w).sum(), [q, k, v]),
            strict=True,
        ):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bucket_plan_by_hand() -> None:
    # lengths 3, 1, 2 at offsets 0, 3, 4 (tokens 0..5). Sorted: 1 (seq 1), 2 (seq 2), 3 (seq 0).
    # {1}+2: 2·4=8 > 1.25·5 → new; {2}+3: 2·9=18 > 1.25·13=16.25 → new: three singleton buckets.
    plan = make_plan("bucketed", [0, 3, 4, 6], CPU)
    assert [b.idx.tolist() for b in plan.buckets] == [[[3]], [[4, 5]], [[0, 1, 2]]]
    # bucket order of tokens is 3, 4, 5, 0, 1, 2; the inverse puts them back: token 0 is 4th (index 3)
    assert plan.inverse is not None and plan.inverse.tolist() == [3, 4, 5, 0, 1, 2]
    # padded: one bucket, width 3, padding points at each sequence's first token; keep drops it
    padded = make_plan("padded", [0, 3, 4, 6], CPU)
    (only,) = padded.buckets
    assert only.idx.tolist() == [[3, 3, 3], [4, 5, 4], [0, 1, 2]]
    assert only.keep.tolist() == [0, 3, 4, 6, 7, 8]


@pytest.mark.parametrize("name", ["bucketed", "padded", "flex"])
def test_whole_model_log_probs_per_backend(name: str) -> None:
    # flex runs forward only on CPU: no-grad log-probs and entropies; the others also gradients
    grad = name != "flex"
    model = tiny("qwen2")
    use_varlen_attention(model)
    seqs, flat, cu = ragged_batch(lengths=[7, 1, 8, 8, 6, 3])
    ref_lp, ref_ent = reference_log_probs(model, seqs)
    with torch.set_grad_enabled(grad):
        out, has = packed_log_probs(model, flat, cu, chunk_size=4, attention=name)
    assert out.entropy is not None
    torch.testing.assert_close(out.log_probs[has], torch.cat(ref_lp), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy[has], torch.cat(ref_ent), atol=1e-5, rtol=0)
    if grad:
        params = list(model.parameters())
        ref_g = torch.autograd.grad(torch.cat(ref_lp).sum() + 0.1 * torch.cat(ref_ent).sum(), params)
        got_g = torch.autograd.grad(out.log_probs[has].sum() + 0.1 * out.entropy[has].sum(), params)
        for a, b in zip(got_g, ref_g, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_flex_with_grad_on_cpu_raises_with_reason() -> None:
    with pytest.raises(RuntimeError, match=r"model.packed_attention=.flex. cannot run.*no backward on CPU"):
        select_backend("flex", CPU, torch.float32, needs_grad=True)


def test_auto_skips_unavailable_and_failing_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong(q, k, v, plan, scale, dropout):  # type: ignore[no-untyped-def]  # uses q, k, v; wrong output
        return q + k.repeat_interleave(2, 1) + v.repeat_interleave(2, 1)

    broken = Backend(lambda *_: None, wrong)
    absent = Backend(lambda *_: "not installed here", att._sdpa_buckets)
    monkeypatch.setitem(PACKED_ATTENTION._entries, "broken", broken)
    monkeypatch.setitem(PACKED_ATTENTION._entries, "absent", absent)
    monkeypatch.setitem(varlen_sdpa.AUTO_ORDER, "cpu", ("absent", "broken", "padded"))
    monkeypatch.setattr(varlen_sdpa, "_checked", {})
    assert select_backend("auto", CPU, torch.float32, needs_grad=True) == "padded"
    assert "not installed" in str(varlen_sdpa._checked[("absent", "cpu", torch.float32, True)])
    assert "self-check max |Δ|" in str(varlen_sdpa._checked[("broken", "cpu", torch.float32, True)])
    with pytest.raises(RuntimeError, match="cannot run"):
        select_backend("broken", CPU, torch.float32, needs_grad=False)


def test_auto_on_cpu_follows_the_table() -> None:
    assert select_backend("auto", CPU, torch.float32, needs_grad=True) == varlen_sdpa.AUTO_ORDER["cpu"][0]


def test_no_entropy_path_does_not_compute_it(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(50, 8, generator=g)
    targets = torch.randint(0, 50, (9,), generator=g)
    full = chunked_log_probs(hidden, weight, targets, chunk_size=4)
    calls = []
    real_exp = torch.exp

    def counting_exp(x: torch.Tensor) -> torch.Tensor:  # the entropy's p_v = exp(z_v − log Z)
        calls.append(x.shape)
        return real_exp(x)

    monkeypatch.setattr(torch, "exp", counting_exp)
    lean = chunked_log_probs(hidden, weight, targets, chunk_size=4, with_entropy=False)
    assert lean.entropy is None and calls == []
    assert torch.equal(lean.log_probs, full.log_probs)  # bit-identical log-probs
    chunked_log_probs(hidden, weight, targets, chunk_size=4)
    assert len(calls) == 3  # 9 tokens in chunks of 4: one exp per chunk when entropy is asked for


def test_entropy_without_grad_is_the_same_metric() -> None:
    # entropy_grad=False (actor update without an entropy bonus): same values, nothing to backprop
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (9,), generator=g)
    full = chunked_log_probs(hidden, weight, targets, chunk_size=4)
    metric = chunked_log_probs(hidden, weight, targets, chunk_size=4, entropy_grad=False)
    assert full.entropy is not None and metric.entropy is not None
    assert full.entropy.requires_grad and not metric.entropy.requires_grad
    torch.testing.assert_close(metric.entropy, full.entropy.detach(), atol=0, rtol=0)
    g_full = torch.autograd.grad(full.log_probs.sum(), [hidden, weight])
    g_metric = torch.autograd.grad(metric.log_probs.sum(), [hidden, weight])
    for a, b in zip(g_metric, g_full, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_log_probs_at_positions_equal_the_full_pass() -> None:
    # positions (P,) runs the LM head on those rows only: same values and parameter grads as
    # indexing the full (N,) result; a repeated position (padding of gather_index) is allowed
    model = tiny("qwen2")
    _, flat, cu = ragged_batch(lengths=[7, 1, 8, 8, 6, 3])
    positions = torch.tensor([0, 3, 9, 10, 0, 20, 31])
    full, has = packed_log_probs(model, flat, cu, chunk_size=4)
    part, has_p = packed_log_probs(model, flat, cu, chunk_size=4, positions=positions)
    assert full.entropy is not None and part.entropy is not None
    torch.testing.assert_close(part.log_probs, full.log_probs[positions], atol=1e-6, rtol=0)
    torch.testing.assert_close(part.entropy, full.entropy[positions], atol=1e-6, rtol=0)
    assert torch.equal(has_p, has[positions])
    params = list(model.parameters())
    g_full = torch.autograd.grad(full.log_probs[positions].sum(), params)
    g_part = torch.autograd.grad(part.log_probs.sum(), params)
    for a, b in zip(g_part, g_full, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
