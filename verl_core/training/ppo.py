"""One PPO/GRPO iteration, :func:`ppo_iteration`, over a typed :class:`RolloutBatch`
(:mod:`verl_core.training.batch`); it reads like cleanrl's ``ppo.py``: old/ref log-probs and values,
token rewards and advantages, then epochs × shuffled mini-batches of whole prompt groups ×
micro-batches (kernels in :mod:`verl_core.training.ppo_kernels`, metric accounting in
:mod:`verl_core.training.ppo_metrics`).

Losses follow :mod:`verl_core.algorithms`: one :class:`AggNorm` per mini-batch, and every
micro-batch loss is its share of the mini-batch loss, so gradients and the logged metrics do not
depend on micro-batching.

Data parallelism (SPMD under torchrun): every rank passes the *whole* batch; the data-parallel view
comes from the actor engine (:func:`verl_core.training.data_parallel.dp_view`). The no-grad forwards
run on each rank's Karmarkar–Karp shard and are gathered; rewards, advantages and the rollout
correction (:mod:`verl_core.algorithms.rollout_correction`) are computed on the full batch on every rank
(identical, no collective); each mini-batch is split over the ranks and its
``AggNorm`` counts the whole mini-batch; every rank runs the same number of forward/backward calls
(padding micro-batches of weight 0, :mod:`verl_core.training.data_parallel`); the logged metrics are
summed over the ranks, so they equal one process's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from verl_core.algorithms import (
    AggNorm,
    KLController,
    RolloutCorrection,
    apply_kl_penalty,
    explained_variance,
    get_adv_estimator,
    rollout_correction,
    scores_to_token_rewards,
)
from verl_core.algorithms.rollout_correction import RolloutCorrectionSpec
from verl_core.models.packed import PackedCausalLM, PackedScoreModel
from verl_core.runtime.watchdog import beat
from verl_core.timing import timed
from verl_core.training.batch import RolloutBatch, gathered_forward, minibatches
from verl_core.training.data_parallel import DPView, MicroBatch, dp_micro_batches, dp_view, sum_over_ranks
from verl_core.training.engine import NonFiniteError, TrainEngine
from verl_core.training.ppo_kernels import (
    ActorLossSpec,
    LogProbModel,
    actor_loss,
    critic_loss,
    response_log_probs,
    response_values,
)
from verl_core.training.ppo_metrics import MetricLog, batch_metrics

__all__ = [
    "PPOIterationResult",
    "PPOModels",
    "PPOSpec",
    "ppo_iteration",
]


@dataclass(frozen=True)
class PPOModels:
    """What one iteration trains and reads. ``ref`` None: no reference (no KL anywhere)."""

    actor: PackedCausalLM
    actor_engine: TrainEngine
    ref: LogProbModel | None = None
    critic: PackedScoreModel | None = None
    critic_engine: TrainEngine | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(frozen=True)
class PPOSpec:
    """Every setting of one iteration (the stage builds it from the config, where the defaults live)."""

    actor: ActorLossSpec
    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: str
    actor_epochs: int
    actor_mini_batch_groups: int  # prompt groups per actor optimizer step
    critic_epochs: int
    critic_mini_batch_groups: int
    micro_batch_size: int | None  # samples per micro-batch; None: token budgets below
    actor_token_budget: int  # tokens per actor micro-batch
    critic_token_budget: int  # tokens per critic micro-batch (also the values forward)
    log_prob_token_budget: int  # old log-prob forward
    ref_token_budget: int  # reference log-prob forward
    cliprange_value: float
    critic_loss_agg_mode: str
    horizon: float  # H of seq-mean-token-sum-norm: the maximum response length
    update_actor: bool  # False during critic warm-up
    use_rollout_logprobs: bool  # old log-probs = the engine's behaviour log-probs
    rollout_correction: RolloutCorrectionSpec
    share_prompts: bool  # a micro-batch's samples of one prompt store it once (same math)


class PPOIterationResult(NamedTuple):
    """advantages, returns, kl: ``(S, R)`` per response token (kl None without KL in reward);
    metrics: means over the iteration, independent of micro-batching; old_log_probs ``(S, R)``: the
    trainer's π_old of the response tokens, the values the loss used (0 off the response mask)."""

    advantages: Tensor
    returns: Tensor
    kl: Tensor | None
    metrics: dict[str, float]
    old_log_probs: Tensor | None = None


def ppo_iteration(
    models: PPOModels,
    batch: RolloutBatch,
    spec: PPOSpec,
    *,
    kl_ctrl: KLController,
    seed: int,
    where: str = "ppo_iteration",
) -> PPOIterationResult:
    """One PPO iteration (Schulman et al. 2017, Algorithm 1, as in cleanrl's ``ppo.py``):

    1. old log-probs π_old, reference log-probs π_ref, values V (no grad); π_old of the first actor
       mini-batch comes from that step's own forward instead (the policy is still θ_old there; exact:
       ratio 1, its ppo_kl and clip fractions 0), unless π_old is needed before the update (KL in
       the reward, a weighting/rejecting rollout correction, or ``use_rollout_logprobs``);
    2. token rewards r_t (outcome score on the last token, minus β·KL_t with KL in reward) and
       advantages Â_t, returns R_t (``spec.adv_estimator``); the rollout/trainer mismatch of π_old
       against the batch's behaviour log-probs, and its correction (``spec.rollout_correction``:
       importance weights and rejected tokens of the actor loss);
    3. for each epoch, for each shuffled mini-batch of whole prompt groups: one critic step, then
       (after critic warm-up) one actor step, each accumulating gradients over micro-batches.

    Under data parallelism every rank passes the same, whole ``batch`` (see the module docstring);
    the results and metrics are the same on every rank. ``seed`` fixes the mini-batch order.
    Raises :class:`NonFiniteError` (naming ``where``) before any optimizer step when an input is NaN/Inf.
    """
    dp = _dp_of(models)
    timing: dict[str, float] = defaultdict(float)
    mask = batch.response_mask.to(models.device)  # (S, R)
    actor_steps = (
        minibatches(batch.group_ids, spec.actor_mini_batch_groups, spec.actor_epochs, seed)
        if spec.update_actor
        else []
    )
    # the first actor mini-batch trains θ_old itself: its π_old comes from its own forward
    on_policy = _on_policy_rows(spec, actor_steps)

    # 1. Old log-probs (but those of `on_policy`), reference log-probs, values (no grad; each rank
    # its shard, then gathered)
    old_logp, ref_logp, values = _no_grad_forwards(models, batch, spec, mask, timing, dp, on_policy)
    beat(phase="old/ref log-probs and values", sequences=len(batch))

    # 2. Token rewards r_t = score·[t = last] − β·KL_t, then advantages Â_t and returns R_t
    with timed(timing, "adv"):
        scores = batch.scores.to(models.device)  # (S,)
        rewards = _token_rewards(scores, old_logp, ref_logp, mask, spec, kl_ctrl)
        greedy = None if batch.baseline_scores is None else batch.baseline_scores.to(models.device)
        if spec.adv_estimator == "remax" and greedy is None:
            raise ValueError("adv_estimator remax needs baseline scores (the greedy is_baseline rollouts)")
        adv = get_adv_estimator(spec.adv_estimator)(
            token_level_rewards=rewards.token_rewards,
            response_mask=mask,
            index=batch.group_ids.to(models.device),
            values=values,
            greedy_rewards=greedy,
            gamma=spec.gamma,
            lam=spec.lam,
            norm_adv_by_std_in_grpo=spec.norm_adv_by_std_in_grpo,
        )
        finite = {"scores": scores, "advantages": adv.advantages, "returns": adv.returns}
        _check_finite({**finite, "old_log_probs": old_logp}, where)
        # w = π_old/π_behaviour and the rejection mask, on the whole batch on every rank (no collective);
        # with on-policy rows (correction off: metrics only) the metrics wait for their π_old
        corr = _rollout_correction(batch, old_logp, mask, spec if not on_policy else None)

    # 3. Critic, then actor: epochs × shuffled mini-batches of whole groups × micro-batches
    log = MetricLog()
    metrics = {**rewards.metrics, **corr.metrics}
    prompts = batch.prompt_ids if spec.share_prompts else None  # budgets count stored tokens
    if models.critic is not None and models.critic_engine is not None and values is not None:
        critic_in = _CriticInputs(models.critic, batch, spec, values, adv.returns, log, models.device)
        with timed(timing, "update_critic"):
            for rows in minibatches(batch.group_ids, spec.critic_mini_batch_groups, spec.critic_epochs, seed):
                norm = _agg_norm(mask[rows], spec.horizon)  # the whole mini-batch, all ranks
                mbs = dp_micro_batches(
                    rows, batch.lengths, spec.critic_token_budget, dp, spec.micro_batch_size, prompts
                )
                stats = models.critic_engine.step(
                    mbs, partial(_critic_micro_loss, critic_in, norm), where=f"{where} critic"
                )
                log.step({"critic/grad_norm": stats.grad_norm})
        # 1 − Var(R − V)/Var(R) for the values the advantages used, once over the whole batch
        metrics["critic/vf_explained_var"] = float(explained_variance(values, adv.returns, mask))
    if spec.update_actor:
        actor_in = _ActorInputs(
            models.actor, batch, spec, old_logp, adv.advantages, ref_logp, corr, log, models.device
        )
        with timed(timing, "update_actor"):
            for step, rows in enumerate(actor_steps):
                # the whole mini-batch, all ranks; rejected tokens count in no denominator
                norm = _agg_norm(corr.response_mask[rows], spec.horizon)
                mbs = dp_micro_batches(
                    rows, batch.lengths, spec.actor_token_budget, dp, spec.micro_batch_size, prompts
                )
                # step 0 with on-policy rows: each micro-batch writes its π_old (this rank's rows)
                fill = torch.zeros_like(old_logp) if step == 0 and on_policy else None
                stats = models.actor_engine.step(
                    mbs, partial(_actor_micro_loss, actor_in, norm, fill), where=f"{where} actor"
                )
                if fill is not None:
                    old_logp += sum_over_ranks(fill, dp)  # (S, R): the on-policy rows were 0
                log.step({"actor/grad_norm": stats.grad_norm, "actor/lr": stats.lr})
        if on_policy:
            metrics.update(_rollout_correction(batch, old_logp, mask, spec).metrics)

    metrics.update(log.means(dp))
    metrics.update(
        batch_metrics(
            scores, rewards.token_rewards, adv.advantages, adv.returns, values, mask, batch.group_ids
        )
    )
    metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
    metrics["perf/throughput"] = sum(batch.lengths) * spec.actor_epochs / max(sum(timing.values()), 1e-9)
    return PPOIterationResult(adv.advantages, adv.returns, rewards.kl, metrics, old_logp)


def _dp_of(models: PPOModels) -> DPView:
    """The actor engine's data-parallel view; the critic engine must split the batch the same way."""
    dp = dp_view(models.actor_engine)
    if models.critic_engine is not None:
        critic = dp_view(models.critic_engine)
        if (critic.rank, critic.size) != (dp.rank, dp.size):
            raise ValueError(
                f"the critic engine is data-parallel rank {critic.rank} of {critic.size} but the actor "
                f"engine rank {dp.rank} of {dp.size}: build both with the same world and tensor-parallel size"
            )
    return dp


def _on_policy_rows(spec: PPOSpec, actor_steps: list[list[int]]) -> list[int]:
    """Rows whose old log-probs the first actor step computes itself: that step's mini-batch is
    trained by θ_old, so π_old(y) is its own forward's log π_θ(y) (detached), and the ratio is
    exactly 1 (verl skips the old-log-prob pass when the whole update is one such step). None (an
    empty list) when π_old is needed before the update: KL in the reward, a rollout correction
    that weights or rejects tokens, or the engine's log-probs as π_old."""
    if (
        not actor_steps
        or spec.use_rollout_logprobs
        or spec.use_kl_in_reward
        or spec.rollout_correction.enabled
    ):
        return []
    return actor_steps[0]


def _no_grad_forwards(
    models: PPOModels,
    batch: RolloutBatch,
    spec: PPOSpec,
    mask: Tensor,
    timing: dict[str, float],
    dp: DPView,
    on_policy: Sequence[int] = (),
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(S, R)`` old log-probs (recomputed, or the engine's behaviour log-probs; 0 on the
    ``on_policy`` rows, whose first actor step computes them), reference log-probs (None without KL)
    and values (None without a critic)."""
    temperature, device = spec.actor.temperature, models.device
    with timed(timing, "old_log_prob"):
        if spec.use_rollout_logprobs:
            if batch.behaviour_log_probs is None:
                raise ValueError("use_rollout_logprobs needs the batch's behaviour log-probs")
            old_logp = batch.behaviour_log_probs.to(device) * mask
        else:
            actor, skip = models.actor, set(on_policy)
            old_logp = gathered_forward(
                batch, device, spec.log_prob_token_budget, mask, dp,
                lambda b: response_log_probs(actor, b, temperature=temperature)[0],
                rows=[r for r in range(len(batch)) if r not in skip], share_prompts=spec.share_prompts,
            )  # fmt: skip
    ref_logp = None
    if spec.actor.use_kl_loss or spec.use_kl_in_reward:
        ref = models.ref
        if ref is None:
            raise ValueError("KL (actor.use_kl_loss or use_kl_in_reward) needs a reference policy")
        with timed(timing, "ref"):
            ref_logp = gathered_forward(
                batch, device, spec.ref_token_budget, mask, dp,
                lambda b: response_log_probs(ref, b, temperature=temperature)[0],
                share_prompts=spec.share_prompts,
            )  # fmt: skip
    values = None
    if models.critic is not None:
        critic = models.critic
        with timed(timing, "values"):
            values = gathered_forward(
                batch, device, spec.critic_token_budget, mask, dp, lambda b: response_values(critic, b),
                share_prompts=spec.share_prompts,
            )  # fmt: skip
    return old_logp, ref_logp, values


def _rollout_correction(
    batch: RolloutBatch, old_logp: Tensor, mask: Tensor, spec: PPOSpec | None
) -> RolloutCorrection:
    """The mismatch metrics and correction of π_old against the batch's behaviour log-probs; none
    (weights None, the mask as is, no metrics) where there is nothing to compare: no behaviour
    log-probs, or π_old *is* π_behaviour (``use_rollout_logprobs``), or not yet (``spec`` None:
    π_old of some rows is not computed yet; only with the correction off, see :func:`_on_policy_rows`)."""
    if spec is None:
        return RolloutCorrection(weights=None, response_mask=mask, metrics={})
    c = spec.rollout_correction
    if batch.behaviour_log_probs is None or spec.use_rollout_logprobs:
        if c.enabled:
            raise ValueError(
                "rollout correction needs behaviour log-probs and recomputed old log-probs "
                "(not use_rollout_logprobs, where the weight is 1)"
            )
        return RolloutCorrection(weights=None, response_mask=mask, metrics={})
    return rollout_correction(
        old_logp,
        batch.behaviour_log_probs.to(mask.device) * mask,
        mask,
        rollout_is=c.rollout_is,
        rollout_is_threshold=c.rollout_is_threshold,
        rollout_rs=c.rollout_rs,
        rollout_rs_threshold=c.rollout_rs_threshold,
        rollout_rs_threshold_lower=c.rollout_rs_threshold_lower,
        diff_threshold=c.log_prob_diff_threshold,
    )


class _TokenRewards(NamedTuple):
    token_rewards: Tensor  # (S, R)
    kl: Tensor | None  # (S, R) per-token KL of the in-reward penalty
    metrics: dict[str, float]


def _token_rewards(
    scores: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    mask: Tensor,
    spec: PPOSpec,
    kl_ctrl: KLController,
) -> _TokenRewards:
    """r_t = score·[t = last response token] − β·KL_t (the KL term only with ``use_kl_in_reward``);
    the controller moves β with the KL measured over the whole batch (every rank holds all of it)."""
    token_scores = scores_to_token_rewards(scores, mask)  # (S, R)
    if not spec.use_kl_in_reward:
        return _TokenRewards(token_scores, None, {})
    assert ref_logp is not None
    pen = apply_kl_penalty(
        token_level_scores=token_scores,
        old_log_prob=old_logp,
        ref_log_prob=ref_logp,
        response_mask=mask,
        kl_coef=kl_ctrl.value,
        kl_penalty=spec.kl_penalty,
    )
    kl, n = float(pen.stats.kl), len(scores)  # mean sequence KL of the whole batch
    kl_ctrl.update(kl, n_steps=n)
    metrics = {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": pen.stats.kl_coef}
    return _TokenRewards(pen.token_level_rewards, pen.kl, metrics)


@dataclass(frozen=True)
class _ActorInputs:
    """What every actor micro-loss of one iteration reads; per-token tensors ``(S, R)`` of the whole
    batch (the loss mask is ``corr.response_mask``: rejected tokens removed)."""

    actor: PackedCausalLM
    batch: RolloutBatch
    spec: PPOSpec
    old_logp: Tensor
    advantages: Tensor
    ref_logp: Tensor | None
    corr: RolloutCorrection
    log: MetricLog
    device: torch.device


def _actor_micro_loss(c: _ActorInputs, norm: AggNorm, fill_old: Tensor | None, mb: MicroBatch) -> Tensor:
    """The actor loss share of micro-batch ``mb`` (× its weight: 0 for padding) in a mini-batch of
    denominators ``norm``. ``fill_old (S, R)``: the policy is still θ_old (first step), so π_old =
    this forward's log-probs (detached), written there for the later steps; None: π_old from
    ``c.old_logp``."""
    rows = mb.rows
    b = c.batch.micro(rows, c.spec.share_prompts).to(c.device)
    r = b.response_mask.shape[1]
    b = b._replace(response_mask=c.corr.response_mask[rows, :r])
    ref = None if c.ref_logp is None else c.ref_logp[rows, :r]
    weights = None if c.corr.weights is None else c.corr.weights[rows, :r]
    old = None if fill_old is not None else c.old_logp[rows, :r]
    out = actor_loss(c.actor, b, old, c.advantages[rows, :r], ref, c.spec.actor, norm, weights)
    if fill_old is not None and mb.weight:
        fill_old[rows, :r] = out.log_probs
    c.log.micro(out.metrics, float(b.response_mask.sum()), mb.weight)
    return out.loss * mb.weight


@dataclass(frozen=True)
class _CriticInputs:
    """What every critic micro-loss of one iteration reads; ``old_values``, ``returns``: ``(S, R)``."""

    critic: PackedScoreModel
    batch: RolloutBatch
    spec: PPOSpec
    old_values: Tensor
    returns: Tensor
    log: MetricLog
    device: torch.device


def _critic_micro_loss(c: _CriticInputs, norm: AggNorm, mb: MicroBatch) -> Tensor:
    """The critic loss share of micro-batch ``mb`` (× its weight: 0 for padding) in a mini-batch of
    denominators ``norm``."""
    rows = mb.rows
    b = c.batch.micro(rows, c.spec.share_prompts).to(c.device)
    r = b.response_mask.shape[1]
    loss, metrics = critic_loss(
        c.critic,
        b,
        c.old_values[rows, :r],
        c.returns[rows, :r],
        cliprange_value=c.spec.cliprange_value,
        loss_agg_mode=c.spec.critic_loss_agg_mode,
        norm=norm,
    )
    c.log.micro(metrics, float(b.response_mask.sum()), mb.weight)
    return loss * mb.weight


def _agg_norm(mask: Tensor, horizon: float) -> AggNorm:
    """Loss denominators of a whole mini-batch ``mask (B, R)``: its response tokens and sequences."""
    return AggNorm(num_tokens=float(mask.sum()), num_seqs=float(mask.shape[0]), horizon=horizon)


def _check_finite(tensors: dict[str, Tensor], where: str) -> None:
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise NonFiniteError(f"{where}: {name} contains NaN/Inf (before any optimizer step)")
