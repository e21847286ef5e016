"""Packed forward == per-sequence forward (log-probs, entropies, gradients) for tiny Qwen2 and Llama."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from verl_core.models.attention import length_buckets
from verl_core.models.heads import packed_sequence_scores, value_model_from_policy
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.models.packed import (
    PackedCausalLM,
    chunked_log_probs,
    next_token_targets,
    packed_log_probs,
    packed_scores,
    position_ids_from_cu_seqlens,
    use_varlen_attention,
)

LENGTHS = [5, 1, 9, 3]  # ragged, one sequence of a single token (no targets at all)


def tiny(arch: str, seed: int = 0) -> torch.nn.Module:
    spec = ScratchSpec(arch, 32, 2, 4, 2, 64, 64)
    return init_causal_lm(scratch_config(spec, 97, eos_token_id=0, pad_token_id=0), seed=seed).eval()


def ragged_batch(
    seed: int = 0, lengths: list[int] = LENGTHS
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, 97, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return seqs, torch.cat(seqs), cu


def reference_log_probs(model: torch.nn.Module, seqs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
    """One sequence at a time, plain full-vocabulary log_softmax: the readable reference."""
    lps, ents = [], []
    for s in seqs:
        logits = model(input_ids=s[None], use_cache=False).logits[0].float()  # (T, V)
        logp = F.log_softmax(logits, -1)
        lps.append(logp[:-1].gather(-1, s[1:, None]).squeeze(-1))
        ents.append(-(logp.exp() * logp).sum(-1)[:-1])
    return lps, ents


def test_positions_and_targets_by_hand() -> None:
    cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    assert position_ids_from_cu_seqlens(cu).tolist() == [0, 1, 2, 0, 0, 1]
    ids = torch.tensor([10, 11, 12, 20, 30, 31])
    targets, has = next_token_targets(ids, cu)
    # seq 0: 10→11, 11→12, 12 has none; seq 1: 20 has none; seq 2: 30→31, 31 has none
    assert targets.tolist() == [11, 12, 0, 0, 31, 0]
    assert has.tolist() == [True, True, False, False, True, False]


def test_length_buckets_by_hand() -> None:
    # sorted lengths 1 3 6 7 8 8 (indices 1 5 4 0 2 3); a bucket grows while count·max² ≤ 1.25·Σ len²:
    # {1}+3: 2·9=18 > 1.25·10 → new; {3}+6: 72 > 56.25 → new; {6}+7: 98 ≤ 106.25 → {6,7};
    # {6,7}+8: 3·64=192 > 1.25·149=186.25 → new; {8}+8: 128 ≤ 160 → {8,8}
    assert length_buckets([7, 1, 8, 8, 6, 3]) == [[1], [5], [4, 0], [2, 3]]
    assert length_buckets([]) == []
    assert length_buckets([4] * 5) == [[0, 1, 2, 3, 4]]  # equal lengths: one bucket, no padding


@pytest.mark.parametrize("lengths", [LENGTHS, [7, 1, 8, 8, 6, 3]], ids=["singletons", "padded-buckets"])
@pytest.mark.parametrize("varlen", [False, True], ids=["sdpa-mask", "varlen_sdpa"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_equals_per_sequence_logprobs_entropy_and_grads(
    arch: str, varlen: bool, lengths: list[int]
) -> None:
    model = tiny(arch)
    if varlen:
        use_varlen_attention(model)
        assert model.config._attn_implementation == "varlen_sdpa"
    seqs, flat, cu = ragged_batch(lengths=lengths)
    ref_lp, ref_ent = reference_log_probs(model, seqs)
    ref_loss = torch.cat(ref_lp).sum() + 0.1 * torch.cat(ref_ent).sum()
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))

    out, has = packed_log_probs(model, flat, cu, chunk_size=4)  # chunks cross sequence boundaries
    assert out.entropy is not None
    got_lp, got_ent = out.log_probs[has], out.entropy[has]
    torch.testing.assert_close(got_lp, torch.cat(ref_lp), atol=1e-5, rtol=0)
    torch.testing.assert_close(got_ent, torch.cat(ref_ent), atol=1e-5, rtol=0)
    loss = got_lp.sum() + 0.1 * got_ent.sum()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for g_ref, g in zip(ref_grads, grads, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)


def test_use_cache_trap_is_avoided() -> None:
    # transformers 5: with config.use_cache=True transformers creates a cache before building the packed
    # mask and the sequences attend to each other. packed_log_probs forces use_cache=False.
    model = tiny("qwen2")
    model.config.use_cache = True
    seqs, flat, cu = ragged_batch(1)
    ref_lp, _ = reference_log_probs(model, seqs)
    with torch.no_grad():
        out, has = packed_log_probs(model, flat, cu, with_entropy=False)
    torch.testing.assert_close(out.log_probs[has], torch.cat(ref_lp), atol=1e-5, rtol=0)
    assert out.entropy is None


def test_chunk_size_does_not_change_results() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (13,), generator=g)
    full = chunked_log_probs(hidden, weight, targets, chunk_size=1000)
    small = chunked_log_probs(hidden, weight, targets, chunk_size=3)
    torch.testing.assert_close(small.log_probs, full.log_probs)
    # readable reference: full log_softmax
    ref = F.log_softmax(hidden @ weight.T, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(full.log_probs, ref)
    g1 = torch.autograd.grad(small.log_probs.sum(), [hidden, weight])
    g2 = torch.autograd.grad(ref.sum(), [hidden, weight])
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # temperature divides the logits: T=2 equals log_softmax(z / 2)
    half = chunked_log_probs(hidden, weight, targets, chunk_size=4, temperature=2.0)
    ref_t = F.log_softmax(hidden @ weight.T / 2.0, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(half.log_probs, ref_t)


def test_uniform_logits_entropy_by_hand() -> None:
    # zero weights → uniform over V=4: log p = -log 4 = -1.3863, entropy = log 4 = 1.3863
    out = chunked_log_probs(torch.ones(2, 3), torch.zeros(4, 3), torch.tensor([0, 3]))
    torch.testing.assert_close(out.log_probs, torch.full((2,), -1.3862944))
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy, torch.full((2,), 1.3862944))


def test_value_model_from_policy_and_packed_scores() -> None:
    policy = tiny("qwen2")
    critic = value_model_from_policy(policy, seed=0).eval()
    # the backbone is the policy's
    for (name, p), q in zip(policy.model.named_parameters(), critic.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    seqs, flat, cu = ragged_batch()
    with torch.no_grad():
        values = packed_scores(critic, flat, cu)
        ref = torch.cat([critic(input_ids=s[None], use_cache=False).logits[0, :, 0] for s in seqs])
        torch.testing.assert_close(values, ref, atol=1e-5, rtol=0)
        last = packed_sequence_scores(critic, flat, cu)
    assert last.shape == (len(LENGTHS),)
    ends = torch.tensor(LENGTHS).cumsum(0) - 1
    torch.testing.assert_close(last, ref[ends])


def test_reward_model_scores_match_sequence_classification() -> None:
    from transformers import AutoModelForSequenceClassification

    policy = tiny("llama")
    config = policy.config
    config.num_labels = 1
    rm = AutoModelForSequenceClassification.from_config(config).eval()
    seqs, flat, cu = ragged_batch(2)
    with torch.no_grad():
        packed = packed_sequence_scores(rm, flat, cu)
        ref = torch.stack([rm(input_ids=s[None], use_cache=False).logits[0, 0] for s in seqs])
    torch.testing.assert_close(packed, ref, atol=1e-5, rtol=0)


def test_varlen_model_generates_like_sdpa() -> None:
    # outside packed calls varlen_sdpa is transformers' sdpa: same greedy continuation, padded batch too
    ref, varlen = tiny("qwen2"), tiny("qwen2")
    use_varlen_attention(varlen)
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    out_ref = ref.generate(input_ids=ids, attention_mask=mask, **kw)
    out_var = varlen.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(out_ref, out_var)


def test_compiled_layers_match_the_reference_and_leave_generation_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # model.torch_compile: packed forwards run the compiled layer forward (fused, so equal to float
    # rounding); generation (KV cache, no packed keywords) stays eager and compiles nothing
    from torch._dynamo.utils import counters

    import verl_core.models.packed as packed_lib

    packed_calls = []  # the compiled layer forward's dispatch: True → the compiled callable ran
    is_packed = packed_lib._is_packed_call
    monkeypatch.setattr(
        packed_lib, "_is_packed_call", lambda kw: packed_calls.append(is_packed(kw)) or packed_calls[-1]
    )
    model = tiny("qwen2")
    eager = copy.deepcopy(model)
    keys = list(model.state_dict())
    packed = PackedCausalLM(model, chunk_size=4, compile_layers=True)
    assert [type(m).__name__ for m in packed.decoder_layers()] == ["PackedCompiledQwen2DecoderLayer"] * 2
    assert list(model.state_dict()) == keys
    graphs = []
    for lengths in ([7, 1, 8, 8, 6, 3], [4, 12, 2]):  # new lengths and count: no recompilation
        seqs, flat, cu = ragged_batch(lengths=lengths)
        ref_lp, ref_ent = reference_log_probs(eager, seqs)
        ref_grads = torch.autograd.grad(
            torch.cat(ref_lp).sum() + 0.1 * torch.cat(ref_ent).sum(), list(eager.parameters())
        )
        out, has = packed(flat, cu)
        assert out.entropy is not None
        torch.testing.assert_close(out.log_probs[has], torch.cat(ref_lp), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.entropy[has], torch.cat(ref_ent), atol=1e-5, rtol=0)
        grads = torch.autograd.grad(
            out.log_probs[has].sum() + 0.1 * out.entropy[has].sum(), list(model.parameters())
        )
        for g_ref, g in zip(ref_grads, grads, strict=True):
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)
        graphs.append(counters["stats"]["unique_graphs"])
    assert packed_calls == [True] * 4  # 2 batches × 2 layers took the compiled forward

    ids = torch.tensor([[5, 6, 7]])
    kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "use_cache": True}
    assert torch.equal(model.generate(input_ids=ids, **kw), eager.generate(input_ids=ids, **kw))
    assert packed_calls[4:] and not any(packed_calls[4:])  # every generation step ran eager
    assert counters["stats"]["unique_graphs"] == graphs[1]

    # a copy is compiled too and runs its own weights
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(0.5)
        eager.lm_head.weight.mul_(0.5)
    seqs, flat, cu = ragged_batch(3)
    with torch.no_grad():
        out, has = PackedCausalLM(twin)(flat, cu, with_entropy=False)
        ref_lp, _ = reference_log_probs(eager, seqs)
    assert type(twin.model.layers[0]).__name__ == "PackedCompiledQwen2DecoderLayer"
    torch.testing.assert_close(out.log_probs[has], torch.cat(ref_lp), atol=1e-5, rtol=0)


def test_checkpointed_packed_forward_selects_its_backend_inside_the_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # model.gradient_checkpointing with packed attention: the first grad-enabled layer call runs the
    # backend self-check (its own autograd.grad) inside the checkpointed layer; it used to fail there
    from verl_core.models import varlen_sdpa
    from verl_core.models.loading import enable_gradient_checkpointing

    monkeypatch.setattr(varlen_sdpa, "_checked", {})  # no cached check from earlier tests
    plain, ckpt = tiny("qwen2"), tiny("qwen2")
    enable_gradient_checkpointing(ckpt)
    _, flat, cu = ragged_batch(lengths=[7, 1, 8, 8, 6, 3])
    results = []
    for m in (ckpt, plain):  # the checkpointed one first: its first layer call runs the check
        m.train()
        out, has = PackedCausalLM(m)(flat, cu, with_entropy=False)
        loss = out.log_probs[has].sum()
        results.append((loss, torch.autograd.grad(loss, list(m.parameters()))))
    torch.testing.assert_close(results[1][0], results[0][0])
    for a, b in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(a, b)
