"""ppo_iteration: against a readable per-sample reference loop, determinism per seed, micro-batch
invariance of the weights *and* of every logged metric, ReMax baselines (RolloutBatch: test_batch.py)"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.verl_core.training.specs import ppo_spec
from tests.verl_core.training.test_ppo import decoder_token_counts
from verl_core.algorithms import make_kl_controller
from verl_core.models.heads import value_model_from_policy
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.models.packed import PackedCausalLM, PackedScoreModel
from verl_core.training.batch import RolloutBatch, minibatches
from verl_core.training.engine import NonFiniteError, OptimSpec, TrainEngine
from verl_core.training.ppo import PPOIterationResult, PPOModels, PPOSpec, ppo_iteration
from verl_core.training.ppo_kernels import ActorLossSpec, response_log_probs

VOCAB = 61
# 3 prompt groups × 2 samples, ragged prompts (1-3 tokens) and responses (1-4 tokens)
PROMPTS = [[1, 2], [1, 2], [7, 8, 9], [7, 8, 9], [11], [11]]
RESPONSES = [[3, 4, 5], [6], [10, 12], [13, 14, 15, 16], [17], [18, 19]]
GROUPS = [0, 0, 1, 1, 2, 2]
SCORES = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0]
LR = 1e-2


def tiny_lm(seed: int = 0) -> torch.nn.Module:
    spec = ScratchSpec("qwen2", 32, 2, 4, 2, 64, 64)
    return init_causal_lm(scratch_config(spec, VOCAB, eos_token_id=0, pad_token_id=0), seed=seed)


def plain_optim() -> OptimSpec:
    # constant LR, no decay, no clipping: the reference loop's bare AdamW takes the same steps
    return OptimSpec(
        lr=LR, weight_decay=0.0, warmup_steps=0, total_steps=100, scheduler="constant", grad_clip=1e9
    )


def make_batch(**kw: object) -> RolloutBatch:
    fields: dict[str, object] = {
        "prompt_ids": PROMPTS,
        "response_ids": RESPONSES,
        "group_ids": torch.tensor(GROUPS),
        "sample_index": torch.tensor([0, 1] * 3),
        "scores": torch.tensor(SCORES),
    }
    fields.update(kw)
    return RolloutBatch(**fields)  # type: ignore[arg-type]


def make_spec(**kw: object) -> PPOSpec:
    actor = ActorLossSpec(
        policy_loss="vanilla",
        loss_agg_mode=str(kw.pop("loss_agg_mode", "token-mean")),
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        clip_ratio_c=3.0,
        entropy_coeff=float(kw.pop("entropy_coeff", 0.0)),  # type: ignore[arg-type]
        use_kl_loss=bool(kw.pop("use_kl_loss", False)),
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        temperature=1.0,
    )
    base: dict[str, object] = {
        "adv_estimator": "grpo",
        "actor_epochs": 2,
        "actor_mini_batch_groups": 2,  # 3 groups → mini-batches of 2 and 1 groups per epoch
        "critic_epochs": 2,
        "critic_mini_batch_groups": 2,
        "horizon": 4.0,
    }
    base.update(kw)
    return ppo_spec(actor, **base)


def make_models(*, critic: bool = False, ref: bool = False) -> PPOModels:
    lm = tiny_lm()
    actor = PackedCausalLM(lm)
    models = PPOModels(actor, TrainEngine(actor, plain_optim()))
    if ref:
        frozen = PackedCausalLM(tiny_lm(seed=5).eval().requires_grad_(False))
        models = PPOModels(models.actor, models.actor_engine, ref=frozen)
    if critic:
        value = PackedScoreModel(value_model_from_policy(lm, seed=1))
        models = PPOModels(
            models.actor, models.actor_engine, models.ref, value, TrainEngine(value, plain_optim())
        )
    return models


def run(
    models: PPOModels, spec: PPOSpec, batch: RolloutBatch | None = None, seed: int = 3
) -> PPOIterationResult:
    kl = make_kl_controller("fixed", kl_coef=0.05, target_kl=0.1, horizon=1000)
    return ppo_iteration(models, batch or make_batch(), spec, kl_ctrl=kl, seed=seed)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- a readable reference loop ---------------------------------------------------------------------------


def reference_grpo(lm: torch.nn.Module, seed: int) -> torch.nn.Module:
    """GRPO + PPO clip, token-mean, written sample by sample with plain HF forwards and AdamW."""
    lm = copy.deepcopy(lm)

    def logp(model: torch.nn.Module, s: int) -> torch.Tensor:
        ids = torch.tensor([PROMPTS[s] + RESPONSES[s]])
        logits = model(input_ids=ids, use_cache=False).logits[0].float()  # (P+R, V)
        p = len(PROMPTS[s])
        # position p−1+j predicts response token j
        pred = logits[p - 1 : p - 1 + len(RESPONSES[s])]
        return F.log_softmax(pred, -1).gather(-1, torch.tensor(RESPONSES[s])[:, None])[:, 0]  # (R_s,)

    with torch.no_grad():
        old = [logp(lm, s) for s in range(len(PROMPTS))]
    # GRPO: A_s = (r_s − mean_g) / (std_g + 1e-6), std unbiased over the group (2 samples)
    scores = torch.tensor(SCORES)
    adv = []
    for s, g in enumerate(GROUPS):
        members = scores[[i for i, h in enumerate(GROUPS) if h == g]]
        adv.append(float((scores[s] - members.mean()) / (members.std() + 1e-6)))
    optim = torch.optim.AdamW(lm.parameters(), lr=LR, weight_decay=0.0)
    lm.train()
    for rows in minibatches(torch.tensor(GROUPS), 2, 2, seed):
        optim.zero_grad()
        terms, n_tokens = [], 0
        for s in rows:
            ratio = torch.exp(logp(lm, s) - old[s])  # (R_s,)
            pg1 = -adv[s] * ratio
            pg2 = -adv[s] * ratio.clamp(0.8, 1.2)
            terms.append(torch.maximum(pg1, pg2).sum())
            n_tokens += len(RESPONSES[s])
        (torch.stack(terms).sum() / n_tokens).backward()  # token-mean over the mini-batch
        optim.step()
    return lm


def test_matches_the_reference_loop() -> None:
    models = make_models()
    start = copy.deepcopy(models.actor.lm)
    run(models, make_spec(), seed=3)
    expected = reference_grpo(start, seed=3)
    got = models.actor.lm.state_dict()
    for name, value in expected.state_dict().items():
        if name.endswith("k_proj.bias"):
            # exact gradient 0 (a key bias adds q·b to every score of a query, which softmax ignores):
            # AdamW turns the float noise there into ±lr steps, so no two computations agree on it
            continue
        torch.testing.assert_close(got[name], value, atol=2e-5, rtol=1e-4, msg=name)


def _no_grad_actor_rows(models: PPOModels) -> list[int]:
    """Counts the samples the actor's no-grad (old log-prob) forwards see, in a list of one."""
    seen = [0]

    def count(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if not torch.is_grad_enabled():
            seen[0] += len(args[1]) - 1  # cu_seqlens (S+1,)

    models.actor.register_forward_pre_hook(count)
    return seen


@pytest.mark.parametrize("epochs, groups_per_step", [(2, 2), (1, 3)])
def test_first_mini_batch_old_log_probs_come_from_its_own_forward(
    monkeypatch: pytest.MonkeyPatch, epochs: int, groups_per_step: int
) -> None:
    # the first actor step trains θ_old itself: its π_old is its own forward's log-probs (detached),
    # so the old-log-prob pass skips its rows. Reference: the same iteration with the full pass.
    # (2, 2): 3 groups of 2 → first step 2 groups = 4 of 6 samples, the pass runs on the other 2;
    # (1, 3): one step of the whole batch (fully on-policy, as verl): no old-log-prob pass at all
    behaviour = torch.full((6, 4), -1.0)  # the mismatch metrics read π_old of every row
    batch = make_batch(behaviour_log_probs=behaviour * make_batch().response_mask)
    spec = make_spec(actor_epochs=epochs, actor_mini_batch_groups=groups_per_step, use_kl_loss=True)
    fast, full = make_models(ref=True), make_models(ref=True)
    fast_rows, full_rows = _no_grad_actor_rows(fast), _no_grad_actor_rows(full)
    got = run(fast, spec, batch)
    with monkeypatch.context() as m:
        m.setattr("verl_core.training.ppo._on_policy_rows", lambda spec, steps: [])
        expected = run(full, spec, batch)
    assert full_rows[0] == 6
    assert fast_rows[0] == {(2, 2): 2, (1, 3): 0}[(epochs, groups_per_step)]
    wf, we = weights(fast.actor), weights(full.actor)
    for name in we:
        if not name.endswith("k_proj.bias"):  # exact gradient 0: AdamW steps on float noise there
            torch.testing.assert_close(wf[name], we[name], atol=1e-5, rtol=1e-4, msg=name)
    for key, value in expected.metrics.items():
        if not key.startswith(("timing", "perf")):
            assert got.metrics[key] == pytest.approx(value, abs=1e-5), key
    assert "rollout_corr/kl" in got.metrics  # computed once every row has its π_old
    torch.testing.assert_close(got.advantages, expected.advantages)


def test_minibatches_keep_groups_whole_and_reshuffle_per_epoch() -> None:
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    mbs = minibatches(groups, 3, 2, seed=7)
    # 4 groups in mini-batches of 3 groups: [3 groups, 1 group] per epoch → 6, 2, 6, 2 rows
    assert [len(m) for m in mbs] == [6, 2, 6, 2]
    for m in mbs:
        assert {r // 2 for r in m} == {int(groups[r]) for r in m}
        assert all(r ^ 1 in m for r in m)  # both samples of every group together
    assert sorted(mbs[0] + mbs[1]) == list(range(8)) == sorted(mbs[2] + mbs[3])
    assert mbs == minibatches(groups, 3, 2, seed=7)


# --- determinism ---------------------------------------------------------------------------------------


def test_same_seed_same_result_other_seed_other_order() -> None:
    a, b, c = make_models(), make_models(), make_models()
    ra, rb, rc = run(a, make_spec(), seed=3), run(b, make_spec(), seed=3), run(c, make_spec(), seed=4)
    wa, wb, wc = weights(a.actor), weights(b.actor), weights(c.actor)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert {k: v for k, v in ra.metrics.items() if not k.startswith(("timing", "perf"))} == {
        k: v for k, v in rb.metrics.items() if not k.startswith(("timing", "perf"))
    }
    # another seed draws another mini-batch order, so the weights differ
    assert minibatches(torch.tensor(GROUPS), 2, 2, 3) != minibatches(torch.tensor(GROUPS), 2, 2, 4)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    assert rc.metrics["critic/score/mean"] == ra.metrics["critic/score/mean"]


# --- micro-batch invariance ------------------------------------------------------------------------------

INVARIANT = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vf_explained_var",
    "critic/vpred_mean",
    "critic/grad_norm",
    "critic/advantages/mean",
)


def record_gradients(engine: TrainEngine) -> list[list[torch.Tensor]]:
    """The gradients each optimizer step of ``engine`` applies, recorded as it takes them."""
    steps: list[list[torch.Tensor]] = []

    def record(*_: object) -> None:
        steps.append([p.grad.detach().clone() for p in engine.params if p.grad is not None])

    engine.optimizer.register_step_pre_hook(record)
    return steps


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_weights_and_metrics_do_not_depend_on_micro_batching(loss_agg_mode: str) -> None:
    results, grads, finals = [], [], []
    for micro in (None, 1, 2):  # one micro-batch per mini-batch (token budget), 1 and 2 samples each
        models = make_models(critic=True, ref=True)
        assert models.critic_engine is not None and models.critic is not None
        actor_grads, critic_grads = (
            record_gradients(models.actor_engine),
            record_gradients(models.critic_engine),
        )
        spec = make_spec(
            adv_estimator="gae",
            use_kl_loss=True,
            entropy_coeff=0.01,
            loss_agg_mode=loss_agg_mode,
            micro_batch_size=micro,
            critic_loss_agg_mode=loss_agg_mode,
        )
        results.append(run(models, spec))
        grads.append([actor_grads[0], critic_grads[0]])
        finals.append({**weights(models.actor), **weights(models.critic)})
    for name in INVARIANT:
        values = [r.metrics[name] for r in results]
        assert values == pytest.approx([values[0]] * 3, rel=1e-4, abs=1e-6), name
    # the first actor and critic steps start from the same weights: the gradients accumulated over
    # micro-batches equal the mini-batch gradient
    for other in grads[1:]:
        for which, (got, want) in zip(("actor", "critic"), zip(other, grads[0], strict=True), strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4, msg=which)
    # weights: AdamW divides by √v, so a weight whose true gradient is ~0 can move by up to lr per
    # step on float noise alone; 1e-3 is a tenth of one step (lr 1e-2) and catches any real difference
    for other in finals[1:]:
        for k, v in finals[0].items():
            torch.testing.assert_close(other[k], v, atol=1e-3, rtol=1e-3, msg=k)


def test_shared_prompts_train_like_full_sequences() -> None:
    # model.share_prompts: each group's prompt (PROMPTS come in pairs) is stored once in the old/ref
    # log-prob, value, actor and critic forwards; same first gradients, metrics and weights
    results, grads, finals, tokens = [], [], [], []
    for share in (False, True):
        models = make_models(critic=True, ref=True)
        assert models.critic_engine is not None and models.critic is not None
        assert isinstance(models.ref, PackedCausalLM)
        seen = [decoder_token_counts(m) for m in (models.actor.lm, models.ref.lm, models.critic.model)]
        actor_grads, critic_grads = (
            record_gradients(models.actor_engine),
            record_gradients(models.critic_engine),
        )
        spec = make_spec(adv_estimator="gae", use_kl_loss=True, entropy_coeff=0.01, share_prompts=share)
        results.append(run(models, spec))
        grads.append([actor_grads[0], critic_grads[0]])
        finals.append({**weights(models.actor), **weights(models.critic)})
        tokens.append([sum(counts) for counts in seen])
    # actor, reference and critic forwards: the 6 samples are 3 pairs with one prompt each (2, 3 and 1
    # tokens), stored once per micro-batch that holds the pair
    assert all(shared < full for shared, full in zip(tokens[1], tokens[0], strict=True)), tokens
    for name in INVARIANT:
        assert results[1].metrics[name] == pytest.approx(results[0].metrics[name], rel=1e-4, abs=1e-6), name
    torch.testing.assert_close(results[1].advantages, results[0].advantages, atol=1e-5, rtol=1e-4)
    for got, want in zip(grads[1], grads[0], strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)
    for k, v in finals[0].items():  # tolerance: see the micro-batching test above
        torch.testing.assert_close(finals[1][k], v, atol=1e-3, rtol=1e-3, msg=k)


def test_logged_losses_are_mini_batch_losses() -> None:
    # the pg loss of the first step at ratio 1 is −(token-mean advantage) of its mini-batch: with one
    # epoch and all 3 groups in one mini-batch it is −Σ_s A_s·R_s / Σ_s R_s. GRPO: A = (r − mean)/(std +
    # 1e-6) per pair; (1, 0): ±0.5/0.70711, (0.5, 0): ±0.25/0.35355, so every |A| = c = 0.70711:
    # A = [+c, −c, −c, +c, +c, −c], token counts R = [3, 1, 2, 4, 1, 2] (13 tokens)
    c = 0.5 / (0.70710678 + 1e-6)
    expected = -(3 * c - 1 * c - 2 * c + 4 * c + 1 * c - 2 * c) / 13  # = −3c/13 ≈ −0.16318
    for micro in (None, 1, 3):
        spec = make_spec(actor_epochs=1, actor_mini_batch_groups=3, micro_batch_size=micro)
        result = run(make_models(), spec)
        assert result.metrics["actor/pg_loss"] == pytest.approx(expected, rel=1e-5)


# --- advantages, KL in reward, baselines, errors ---------------------------------------------------------


def test_remax_uses_the_baseline_scores() -> None:
    # A_t = score − baseline on every response token (undiscounted return of an outcome reward);
    # distinct baselines per group (0.25, 0.75, 0.5) so a group mix-up changes the result
    baseline = torch.tensor([0.25, 0.25, 0.75, 0.75, 0.5, 0.5])
    result = run(make_models(), make_spec(adv_estimator="remax"), make_batch(baseline_scores=baseline))
    # scores 1, 0 | 0, 1 | 0.5, 0 → advantages 0.75, −0.25 | −0.75, 0.25 | 0, −0.5
    expected = [0.75, -0.25, -0.75, 0.25, 0.0, -0.5]
    for s, r in enumerate(RESPONSES):
        assert result.advantages[s, : len(r)].tolist() == pytest.approx([expected[s]] * len(r))
    with pytest.raises(ValueError, match="remax needs baseline scores"):
        run(make_models(), make_spec(adv_estimator="remax"))


def test_kl_in_reward_is_the_k1_estimate_per_token() -> None:
    # k1: KL_t = log π_old(y_t) − log π_ref(y_t) on every response token (0 past the end); the logged
    # penalty is the mean over samples of each sample's mean token KL
    models = make_models(ref=True)
    batch = make_batch()
    with torch.no_grad():
        packed = batch.micro(range(6))
        old = response_log_probs(models.actor, packed)[0]
        ref = response_log_probs(models.ref, packed)[0]  # type: ignore[arg-type]
    result = run(models, make_spec(use_kl_in_reward=True, kl_penalty="kl"), batch)
    assert result.kl is not None
    torch.testing.assert_close(result.kl, (old - ref) * packed.response_mask, atol=1e-5, rtol=1e-4)
    per_sample = [float((old - ref)[s, : len(r)].mean()) for s, r in enumerate(RESPONSES)]
    assert result.metrics["actor/reward_kl_penalty"] == pytest.approx(sum(per_sample) / 6, rel=1e-4)
    assert result.metrics["actor/reward_kl_penalty_coeff"] == 0.05
    with pytest.raises(ValueError, match="needs a reference policy"):
        run(make_models(), make_spec(use_kl_in_reward=True))


def test_loss_mask_removes_tokens_from_the_update() -> None:
    # ReMax advantages are per sample (no group statistics), so masking every token of sample 3 must
    # give exactly the gradient of the batch without sample 3 (loss denominators included)
    baseline = torch.tensor([0.25, 0.25, 0.75, 0.75, 0.5, 0.5])
    spec = make_spec(adv_estimator="remax", actor_epochs=1, actor_mini_batch_groups=3)
    mask = torch.ones(6, 4)
    mask[3] = 0.0
    masked_models = make_models()
    masked_grads = record_gradients(masked_models.actor_engine)
    result = run(masked_models, spec, make_batch(loss_mask=mask, baseline_scores=baseline))
    keep = [0, 1, 2, 4, 5]
    dropped_models = make_models()
    dropped_grads = record_gradients(dropped_models.actor_engine)
    dropped = make_batch(
        prompt_ids=[PROMPTS[i] for i in keep],
        response_ids=[RESPONSES[i] for i in keep],
        group_ids=torch.tensor([GROUPS[i] for i in keep]),
        sample_index=torch.tensor([0, 1, 0, 0, 1]),
        scores=torch.tensor([SCORES[i] for i in keep]),
        baseline_scores=baseline[keep],
    )
    run(dropped_models, spec, dropped)
    for g, w in zip(masked_grads[0], dropped_grads[0], strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)
    assert (result.advantages[3] == 0).all()
    assert result.metrics["response_length/mean"] == pytest.approx((3 + 1 + 2 + 0 + 1 + 2) / 6)


def test_non_finite_scores_stop_before_any_step() -> None:
    models = make_models()
    before = weights(models.actor)
    scores = torch.tensor([1.0, float("nan"), 0.0, 1.0, 0.5, 0.0])
    with pytest.raises(NonFiniteError, match=r"it 7: scores contains NaN/Inf \(before any optimizer step\)"):
        ppo_iteration(
            models,
            make_batch(scores=scores),
            make_spec(),
            kl_ctrl=make_kl_controller("fixed", kl_coef=0.0, target_kl=0.1, horizon=1),
            seed=0,
            where="it 7",
        )
    assert all(torch.equal(v, weights(models.actor)[k]) for k, v in before.items())


def test_rollout_logprobs_serve_as_old_logprobs() -> None:
    # behaviour log-probs equal to the recomputed ones give the same update
    a, b = make_models(), make_models()
    ra = run(a, make_spec())
    with torch.no_grad():
        behaviour = response_log_probs(make_models().actor, make_batch().micro(range(6)))[0]
    run(b, make_spec(use_rollout_logprobs=True), make_batch(behaviour_log_probs=behaviour))
    wa, wb = weights(a.actor), weights(b.actor)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-5)
    assert ra.metrics["critic/score/mean"] == pytest.approx(sum(SCORES) / 6)


def test_data_parallel_group_of_one_changes_nothing() -> None:
    # an engine whose strategy reports a data-parallel group of one rank: the collectives run (sums
    # over one rank) and change nothing
    a, b = make_models(), make_models()
    run(a, make_spec())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        strategy = b.actor_engine.strategy
        strategy.dp_rank, strategy.dp_size, strategy.dp_group = 0, 1, dist.group.WORLD  # type: ignore[attr-defined]
        kl = make_kl_controller("fixed", kl_coef=0.0, target_kl=0.1, horizon=1)
        ppo_iteration(b, make_batch(), make_spec(), kl_ctrl=kl, seed=3)
    finally:
        dist.destroy_process_group()
    wa, wb = weights(a.actor), weights(b.actor)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_actor_and_critic_engines_must_split_the_batch_alike() -> None:
    # the data-parallel view comes from the actor engine; a critic engine on another split would
    # train on other rows than the ones its loss denominators count
    models = make_models(critic=True)
    two_ranks = SimpleNamespace(strategy=SimpleNamespace(dp_rank=0, dp_size=2, dp_group=None))
    with pytest.raises(
        ValueError, match="critic engine is data-parallel rank 0 of 2 but the actor engine rank 0 of 1"
    ):
        run(PPOModels(models.actor, models.actor_engine, None, models.critic, two_ranks), make_spec())  # type: ignore[arg-type]
