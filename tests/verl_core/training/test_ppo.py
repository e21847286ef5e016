"""PPO kernels on packed rollouts: batch layout by hand, packed log-probs / values against a per-sample
HF forward, token rewards by hand, actor loss at ratio 1, micro-batch splitting invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verl_core.algorithms import agg_norm_for, scores_to_token_rewards
from verl_core.models.heads import value_model_from_policy
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.models.packed import PackedCausalLM, PackedScoreModel
from verl_core.training.ppo_kernels import (
    ActorLossSpec,
    actor_loss,
    critic_loss,
    make_ppo_batch,
    response_log_probs,
    response_values,
)

VOCAB = 61
# ragged: responses of 3, 1, 0 and 4 tokens; prompts of 2, 3, 1 and 1 tokens
PROMPTS = [[1, 2], [7, 8, 9], [11], [20]]
RESPONSES = [[3, 4, 5], [10], [], [21, 22, 23, 24]]


def tiny_lm(seed: int = 0) -> torch.nn.Module:
    spec = ScratchSpec("qwen2", 32, 2, 4, 2, 64, 64)
    return init_causal_lm(scratch_config(spec, VOCAB, eos_token_id=0, pad_token_id=0), seed=seed).eval()


def actor_spec(**kw: object) -> ActorLossSpec:
    base: dict[str, object] = {
        "policy_loss": "vanilla",
        "loss_agg_mode": "token-mean",
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": 3.0,
        "entropy_coeff": 0.0,
        "use_kl_loss": False,
        "kl_loss_coef": 0.0,
        "kl_loss_type": "low_var_kl",
        "temperature": 1.0,
    }
    base.update(kw)
    return ActorLossSpec(**base)  # type: ignore[arg-type]


# --- make_ppo_batch ------------------------------------------------------------------------------------


def test_make_ppo_batch_layout_by_hand() -> None:
    b = make_ppo_batch([[1, 2], [7, 8, 9], [11]], [[3, 4, 5], [10], [12, 13]])
    # packed: [1 2 3 4 5 | 7 8 9 10 | 11 12 13] at positions 0..4 | 5..8 | 9..11
    assert b.input_ids.tolist() == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13]
    assert b.cu_seqlens.tolist() == [0, 5, 9, 12] and b.cu_seqlens.dtype == torch.int32
    # sample 0: position 1 (token 2) predicts 3, 2 predicts 4, 3 predicts 5
    # sample 1: position 7 (token 9) predicts 10; sample 2: 9 (token 11) predicts 12, 10 predicts 13
    assert b.gather_index.tolist() == [[1, 2, 3], [7, 0, 0], [9, 10, 0]]
    assert b.response_mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    # next token of every gathered position is the response token it predicts
    ids = b.input_ids
    for s, r in enumerate([[3, 4, 5], [10], [12, 13]]):
        assert [int(ids[int(b.gather_index[s, j]) + 1]) for j in range(len(r))] == r


def test_make_ppo_batch_empty_response_and_errors() -> None:
    b = make_ppo_batch([[1, 2], [7]], [[3], []])
    # [1 2 3 | 7]: the empty response is a zero mask row (its gather index 0 is never read)
    assert b.input_ids.tolist() == [1, 2, 3, 7]
    assert b.cu_seqlens.tolist() == [0, 3, 4]
    assert b.gather_index.tolist() == [[1], [0]]
    assert b.response_mask.tolist() == [[1.0], [0.0]]
    # all responses empty: R = 1, all masked
    none = make_ppo_batch([[1], [2, 3]], [[], []])
    assert none.response_mask.tolist() == [[0.0], [0.0]]
    with pytest.raises(ValueError, match="sample 1 has an empty prompt"):
        make_ppo_batch([[1], []], [[2], [3]])
    with pytest.raises(ValueError, match="2 prompts for 1 responses"):
        make_ppo_batch([[1], [2]], [[3]])


def test_make_ppo_batch_shared_prompts_by_hand() -> None:
    b = make_ppo_batch([[1, 2], [1, 2], [7], [1, 2]], [[3, 4], [5], [8], []], share_prompts=True)
    # full stream [1 2 3 4 | 1 2 5 | 7 8 | 1 2], positions 0..3 | 4..6 | 7..8 | 9..10: unchanged
    assert b.input_ids.tolist() == [1, 2, 3, 4, 1, 2, 5, 7, 8, 1, 2]
    assert b.cu_seqlens.tolist() == [0, 4, 7, 9, 11]
    assert b.gather_index.tolist() == [[1, 2], [5, 0], [7, 0], [0, 0]]
    assert b.shared is not None
    # stored: [1 2 3 4 5 7 8], the prompt [1 2] once (samples 1 and 3 read stored 0, 1)
    assert b.shared.unique.tolist() == [0, 1, 2, 3, 6, 7, 8]
    assert b.shared.expand.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6, 0, 1]
    assert b.input_ids[b.shared.unique][b.shared.expand].tolist() == b.input_ids.tolist()
    # nothing to share: no layout
    assert make_ppo_batch([[1], [2]], [[3], [4]], share_prompts=True).shared is None
    assert make_ppo_batch([[1], [1]], [[3], [4]]).shared is None


# --- log-probs and values against a plain per-sample forward --------------------------------------------


def reference_response_log_probs(
    lm: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]], temperature: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One sample at a time: HF forward on prompt ⧺ response, log_softmax(logits / T), the rows at
    positions P−1 .. P+R−2 gathered at the response tokens (and the entropies of those rows)."""
    lps, ents = [], []
    for p, r in zip(prompts, responses, strict=True):
        ids = torch.tensor([p + r])
        logits = lm(input_ids=ids, use_cache=False).logits[0].float() / temperature  # (P+R, V)
        logp = F.log_softmax(logits, -1)[len(p) - 1 : len(p) + len(r) - 1]  # (R, V)
        lps.append(logp.gather(-1, torch.tensor(r, dtype=torch.long)[:, None]).squeeze(-1))
        ents.append(-(logp.exp() * logp).sum(-1))
    return lps, ents


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_log_probs_equal_per_sample_forward(temperature: float) -> None:
    lm = tiny_lm()
    ref_lp, ref_ent = reference_response_log_probs(lm, PROMPTS, RESPONSES, temperature)
    batch = make_ppo_batch(PROMPTS, RESPONSES)
    logp, ent = response_log_probs(PackedCausalLM(lm), batch, temperature=temperature, with_entropy=True)
    assert ent is not None
    assert logp.shape == ent.shape == (4, 4)  # R = 4, the longest response
    for s, r in enumerate(RESPONSES):
        torch.testing.assert_close(logp[s, : len(r)], ref_lp[s], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[s, : len(r)], ref_ent[s], atol=1e-5, rtol=0)
        assert (logp[s, len(r) :] == 0).all() and (ent[s, len(r) :] == 0).all()  # masked
    no_ent = response_log_probs(PackedCausalLM(lm), batch, temperature=temperature)[1]
    assert no_ent is None


def test_response_values_equal_per_sample_token_classification() -> None:
    critic = value_model_from_policy(tiny_lm(), seed=3).eval()
    # reference first: PackedScoreModel switches the attention implementation to varlen_sdpa
    ref = []
    for p, r in zip(PROMPTS, RESPONSES, strict=True):
        logits = critic(input_ids=torch.tensor([p + r]), use_cache=False).logits[0, :, 0]  # (P+R,)
        ref.append(logits[len(p) - 1 : len(p) + len(r) - 1])  # V(state before response token j)
    values = response_values(PackedScoreModel(critic), make_ppo_batch(PROMPTS, RESPONSES))
    assert values.shape == (4, 4)
    for s, r in enumerate(RESPONSES):
        torch.testing.assert_close(values[s, : len(r)], ref[s].float(), atol=1e-5, rtol=0)
        assert (values[s, len(r) :] == 0).all()


# prompt groups, ragged, one response empty and one of a single token
GROUP_PROMPTS = [[1, 2], [7, 8, 9], [1, 2], [7, 8, 9], [1, 2], [11]]
GROUP_RESPONSES = [[3, 4, 5], [10], [6], [12, 13, 14, 15], [], [16, 17]]


def decoder_token_counts(model: torch.nn.Module) -> list[int]:
    """Tokens each call of ``model``'s decoder runs on (recorded by a forward pre-hook)."""
    counts: list[int] = []
    backbone = getattr(model, model.base_model_prefix)
    backbone.register_forward_pre_hook(
        lambda _m, _a, kw: counts.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    return counts


def reference_backend(monkeypatch: pytest.MonkeyPatch) -> str:
    """A packed backend that attends through the readable per-sequence reference on the plan's full
    sequences: like varlen/flash_attn (CUDA) it gets q/k/v gathered by ``expand``, and unlike flex it
    has a CPU backward."""
    from verl_core.models import attention as att

    def attend(q, k, v, plan, scale, dropout):  # type: ignore[no-untyped-def]
        return att.reference_attention(q, k, v, plan.cu_seqlens.tolist(), scale)

    monkeypatch.setitem(att.PACKED_ATTENTION._entries, "gathering", att.Backend(lambda *_: None, attend))
    return "gathering"


@pytest.mark.parametrize("attention", ["bucketed", "padded", "gathering"])
def test_shared_prompts_give_the_log_probs_entropies_and_gradients_of_full_sequences(
    attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if attention == "gathering":
        reference_backend(monkeypatch)
    lm = tiny_lm()
    ref_lp, ref_ent = reference_response_log_probs(lm, GROUP_PROMPTS, GROUP_RESPONSES, 1.0)
    ref_loss = torch.cat(ref_lp).sum() + 0.1 * torch.cat(ref_ent).sum()
    ref_grads = torch.autograd.grad(ref_loss, list(lm.parameters()))
    batch = make_ppo_batch(GROUP_PROMPTS, GROUP_RESPONSES, share_prompts=True)
    # 13 prompt + 11 response tokens; [1 2] stored once for 3 samples, [7 8 9] once for 2: 7 saved
    assert batch.shared is not None and len(batch.shared.unique) == 24 - 7
    seen = decoder_token_counts(lm)
    logp, ent = response_log_probs(PackedCausalLM(lm, attention=attention), batch, with_entropy=True)
    assert seen == [17]  # the model ran on the stored tokens
    assert ent is not None
    for s, r in enumerate(GROUP_RESPONSES):
        torch.testing.assert_close(logp[s, : len(r)], ref_lp[s], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[s, : len(r)], ref_ent[s], atol=1e-5, rtol=0)
    grads = torch.autograd.grad(logp.sum() + 0.1 * ent.sum(), list(lm.parameters()))
    for g_ref, g in zip(ref_grads, grads, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)


def test_shared_prompts_with_flex() -> None:
    # flex (CPU: no-grad only) gathers q/k/v of the full sequences and masks by their block mask
    lm = tiny_lm()
    full = make_ppo_batch(GROUP_PROMPTS, GROUP_RESPONSES)
    shared = make_ppo_batch(GROUP_PROMPTS, GROUP_RESPONSES, share_prompts=True)
    seen = decoder_token_counts(lm)
    with torch.no_grad():
        want = response_log_probs(PackedCausalLM(lm, attention="padded"), full)[0]
        got = response_log_probs(PackedCausalLM(lm, attention="flex"), shared)[0]
    assert seen == [24, 17]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["bucketed", "gathering"])
def test_shared_prompts_give_the_values_and_gradients_of_full_sequences(
    attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if attention == "gathering":
        reference_backend(monkeypatch)
    model = value_model_from_policy(tiny_lm(), seed=3).eval()
    critic = PackedScoreModel(model, attention="padded")
    want = response_values(critic, make_ppo_batch(GROUP_PROMPTS, GROUP_RESPONSES))
    want_grads = torch.autograd.grad(want.pow(2).sum(), list(model.parameters()))
    critic.attention = attention
    seen = decoder_token_counts(model)
    got = response_values(critic, make_ppo_batch(GROUP_PROMPTS, GROUP_RESPONSES, share_prompts=True))
    assert seen == [17]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    grads = torch.autograd.grad(got.pow(2).sum(), list(model.parameters()))
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


# --- token rewards -------------------------------------------------------------------------------------


def test_token_rewards_by_hand() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    scores = torch.tensor([1.0, -0.5, 2.0, 0.25])
    # each score on its sample's last response token; the empty response has nowhere to put it
    expected = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.25, 0.0]]
    assert scores_to_token_rewards(scores, mask).tolist() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_token_rewards_on_cuda() -> None:
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]], device="cuda")
    out = scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)  # CPU scores, CUDA mask
    assert out.device.type == "cuda"
    assert out.tolist() == [[0.0, 1.0], [0.0, 0.0], [3.0, 0.0]]


# --- actor and critic losses ---------------------------------------------------------------------------


def test_actor_loss_at_ratio_one_is_minus_mean_advantage() -> None:
    lm = tiny_lm()
    model = PackedCausalLM(lm)
    batch = make_ppo_batch(PROMPTS, RESPONSES)
    with torch.no_grad():
        old = response_log_probs(model, batch)[0]  # same weights: ratio = 1 on every token
    # the 8 response tokens (3 + 1 + 0 + 4) get advantages 1, 2, 3 | −2 | — | 0.5, 0.5, −1, 4;
    # padding gets 100 (masked, must not count)
    adv = torch.tensor(
        [[1.0, 2.0, 3.0, 100.0], [-2.0, 100.0, 100.0, 100.0], [100.0] * 4, [0.5, 0.5, -1.0, 4.0]]
    )
    # at ratio 1 the clipped surrogate is −A·1 on every token (the dual clip −A·3 is larger for A < 0);
    # token-mean: −(1 + 2 + 3 − 2 + 0.5 + 0.5 − 1 + 4) / 8 = −8 / 8 = −1
    norm = agg_norm_for(batch.response_mask)
    loss, metrics, _ = actor_loss(model, batch, old, adv, None, actor_spec(), norm)
    assert float(loss.detach()) == pytest.approx(-1.0, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="needs reference log-probs"):
        actor_loss(model, batch, old, adv, None, actor_spec(use_kl_loss=True), norm)


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_actor_loss_without_old_log_probs_equals_a_no_grad_old_pass(policy_loss: str) -> None:
    # old_log_probs None: the model is π_old, so π_old = its own log-probs, detached. Reference: the
    # same model's no-grad log-probs passed as old_log_probs (what a separate old pass computes).
    # Same loss, gradients, log-probs; ratio 1 on every token, so ppo_kl and the clip fractions are 0
    model = PackedCausalLM(tiny_lm())
    batch = make_ppo_batch(PROMPTS, RESPONSES)
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    with torch.no_grad():
        old = response_log_probs(model, batch)[0]
    ref = old + 0.3 * batch.response_mask  # a KL term contributes too
    spec = actor_spec(policy_loss=policy_loss, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    norm = agg_norm_for(batch.response_mask)

    reference = actor_loss(model, batch, old, adv, ref, spec, norm)
    reference.loss.backward()
    g_reference = _grads(model)
    model.zero_grad()
    shortcut = actor_loss(model, batch, None, adv, ref, spec, norm)
    shortcut.loss.backward()

    torch.testing.assert_close(shortcut.loss.detach(), reference.loss.detach(), atol=1e-6, rtol=1e-6)
    for a, b in zip(_grads(model), g_reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(shortcut.log_probs, old, atol=1e-6, rtol=0)
    assert not shortcut.log_probs.requires_grad
    assert shortcut.metrics["actor/ppo_kl"] == 0.0
    assert shortcut.metrics["actor/pg_clipfrac"] == 0.0
    assert shortcut.metrics["actor/pg_clipfrac_lower"] == 0.0


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_actor_loss_micro_batches_sum_to_the_mini_batch_loss(agg: str, policy_loss: str) -> None:
    lm = tiny_lm()
    model = PackedCausalLM(lm)
    full = make_ppo_batch(PROMPTS, RESPONSES)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        logp = response_log_probs(model, full)[0]
    # old/ref log-probs off by up to ±0.5 so that clipping, the KL and the entropy all contribute
    old = (logp + (torch.rand(logp.shape, generator=g) - 0.5)) * full.response_mask
    ref = (logp + (torch.rand(logp.shape, generator=g) - 0.5)) * full.response_mask
    adv = torch.randn(logp.shape, generator=g) * full.response_mask
    spec = actor_spec(
        policy_loss=policy_loss,
        loss_agg_mode=agg,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        temperature=0.9,
    )
    norm = agg_norm_for(full.response_mask, horizon=6.0)

    whole, metrics, _ = actor_loss(model, full, old, adv, ref, spec, norm)
    assert metrics["actor/pg_clipfrac"] > 0  # the clip is exercised
    whole.backward()
    g_whole = _grads(model)
    model.zero_grad()

    # micro-batches as the stage slices them: rows of the mini-batch, tensors cut to the micro R
    total = torch.zeros(())
    for rows in ([0, 2], [1], [3]):
        mb = make_ppo_batch([PROMPTS[r] for r in rows], [RESPONSES[r] for r in rows])
        r = mb.response_mask.shape[1]
        part, _, _ = actor_loss(model, mb, old[rows, :r], adv[rows, :r], ref[rows, :r], spec, norm)
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, whole.detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(_grads(model), g_whole, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_critic_loss_micro_batches_sum_to_the_mini_batch_loss(agg: str) -> None:
    critic = PackedScoreModel(value_model_from_policy(tiny_lm(), seed=3).eval())
    full = make_ppo_batch(PROMPTS, RESPONSES)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        values = response_values(critic, full)
    old = (values + (torch.rand(values.shape, generator=g) - 0.5)) * full.response_mask
    returns = torch.randn(values.shape, generator=g) * full.response_mask
    norm = agg_norm_for(full.response_mask, horizon=6.0)
    kw = {"cliprange_value": 0.2, "loss_agg_mode": agg, "norm": norm}

    whole, metrics = critic_loss(critic, full, old, returns, **kw)  # type: ignore[arg-type]
    assert metrics["critic/vf_clipfrac"] > 0
    whole.backward()
    g_whole = _grads(critic)
    critic.zero_grad()
    total = torch.zeros(())
    for rows in ([0, 2], [1, 3]):
        mb = make_ppo_batch([PROMPTS[r] for r in rows], [RESPONSES[r] for r in rows])
        r = mb.response_mask.shape[1]
        part, _ = critic_loss(critic, mb, old[rows, :r], returns[rows, :r], **kw)  # type: ignore[arg-type]
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, whole.detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(_grads(critic), g_whole, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_critic_loss_by_hand_without_clipping() -> None:
    # values v, old values = v (clip inactive): L = ½·mean_tokens (v − R)²; with R = v + δ → ½·mean δ²
    critic = PackedScoreModel(value_model_from_policy(tiny_lm(), seed=3).eval())
    batch = make_ppo_batch([[1, 2], [7]], [[3, 4], [10]])
    with torch.no_grad():
        v = response_values(critic, batch)
    delta = torch.tensor([[1.0, 3.0], [2.0, 50.0]])  # 50 sits on padding
    returns = (v + delta) * batch.response_mask
    loss, _ = critic_loss(
        critic,
        batch,
        v,
        returns,
        cliprange_value=10.0,
        loss_agg_mode="token-mean",
        norm=agg_norm_for(batch.response_mask),
    )
    # ½ · (1² + 3² + 2²) / 3 = ½ · 14 / 3 = 7/3
    assert float(loss.detach()) == pytest.approx(7 / 3, rel=1e-5)
