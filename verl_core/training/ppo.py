"""One PPO/GRPO iteration, :func:`ppo_iteration`, over a typed :class:`RolloutBatch`; it reads like
cleanrl's ``ppo.py``: old/ref log-probs and values, token rewards and advantages, then epochs ×
shuffled mini-batches of whole prompt groups × micro-batches (kernels in
:mod:`verl_core.training.ppo_kernels`).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import NamedTuple

import pyarrow as pa
import torch
from torch import Tensor

from verl_core.algorithms import (
    AggNorm,
    KLController,
    RolloutCorrection,
    apply_kl_penalty,
    explained_variance,
    get_adv_estimator,
    masked_mean,
    rollout_correction,
    scores_to_token_rewards,
)
from verl_core.models.packed import PackedCausalLM, PackedScoreModel
from verl_core.runtime.watchdog import beat
from verl_core.seeding import derive_seed
from verl_core.timing import timed
from verl_core.training.data_parallel import (
    DPView,
    MicroBatch,
    dp_micro_batches,
    dp_view,
    micro_batches,
    sum_over_ranks,
)
from verl_core.training.engine import NonFiniteError, TrainEngine
from verl_core.training.ppo_kernels import (
    ActorLossSpec,
    AdapterDisabledPolicy,
    LogProbModel,
    PPOBatch,
    actor_loss,
    critic_loss,
    make_ppo_batch,
    response_log_probs,
    response_values,
)

__all__ = [
    "ActorLossSpec",
    "AdapterDisabledPolicy",
    "PPOIterationResult",
    "PPOModels",
    "PPOSpec",
    "RolloutBatch",
    "RolloutCorrectionSpec",
    "micro_batches",
    "minibatches",
    "ppo_iteration",
]


@dataclass(frozen=True)
class RolloutBatch:
    """The S training samples of one iteration, built once from the rollouts and rewards tables.

    prompt_ids          S lists of prompt token ids (each ≥ 1 token)
    response_ids        S lists of sampled response token ids (exactly as the engine sampled them)
    group_ids           (S,) int64: the prompt group of each sample (GRPO/RLOO baselines; a mini-batch
                        holds whole groups)
    sample_index        (S,) int64: the sample's index within its group
    scores              (S,) float32: outcome score of each sample
    behaviour_log_probs (S, R) float32 or None: log-probs the rollout engine sampled with
    loss_mask           (S, R) float32 or None: 1 on tokens the policy generated, 0 on tokens it did
                        not (tool output in a multi-turn response); None: every response token
    baseline_scores     (S,) float32 or None: score of the greedy response to the sample's prompt (ReMax)
    """

    prompt_ids: Sequence[Sequence[int]]
    response_ids: Sequence[Sequence[int]]
    group_ids: Tensor
    sample_index: Tensor
    scores: Tensor
    behaviour_log_probs: Tensor | None = None
    loss_mask: Tensor | None = None
    baseline_scores: Tensor | None = None

    def __post_init__(self) -> None:
        s = len(self.prompt_ids)
        for name in ("response_ids", "group_ids", "sample_index", "scores", "baseline_scores"):
            value = getattr(self, name)
            if value is not None and len(value) != s:
                raise ValueError(f"RolloutBatch: {name} has {len(value)} rows for {s} prompts")
        for name in ("behaviour_log_probs", "loss_mask"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != tuple(self.response_mask.shape):
                raise ValueError(
                    f"RolloutBatch: {name} has shape {tuple(value.shape)}, "
                    f"expected {tuple(self.response_mask.shape)} (samples, longest response)"
                )

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @cached_property
    def lengths(self) -> list[int]:
        """Tokens per sample, prompt + response (what a micro-batch's token budget counts)."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids, strict=True)]

    @cached_property
    def response_mask(self) -> Tensor:
        """``(S, R)`` 1.0 on response tokens that count (real, and generated by the policy)."""
        return self.micro(range(len(self))).response_mask

    def micro(self, rows: Sequence[int], share_prompts: bool = False) -> PPOBatch:
        """The packed :class:`PPOBatch` of ``rows`` (on the CPU); ``share_prompts``: rows with the
        same prompt (a prompt group) store it once in the forward passes."""
        masks = None if self.loss_mask is None else [self.loss_mask[r] for r in rows]
        return make_ppo_batch(
            [self.prompt_ids[r] for r in rows],
            [self.response_ids[r] for r in rows],
            loss_masks=masks,
            share_prompts=share_prompts,
        )

    @classmethod
    def from_tables(cls, rollouts: pa.Table, rewards: pa.Table) -> RolloutBatch:
        """The training samples of a ``rollouts`` table (kind "rollouts") and its ``rewards`` table
        (kind "rewards", row-aligned). Rows marked ``is_baseline`` (ReMax's greedy responses) are not
        training samples: their scores become ``baseline_scores`` of their group's samples."""
        if rollouts.num_rows != rewards.num_rows:
            raise ValueError(f"{rollouts.num_rows} rollouts for {rewards.num_rows} rewards")
        for key in ("group_id", "sample_index"):
            # values, not arrow types: in-memory tables may not have the stored int32/int64 widths yet
            if (
                key in rewards.column_names
                and rollouts.column(key).to_pylist() != rewards.column(key).to_pylist()
            ):
                raise ValueError(f"rewards are not aligned with the rollouts (column {key!r} differs)")
        col = {name: rollouts.column(name).to_pylist() for name in _BATCH_COLUMNS}
        names = rollouts.column_names
        baseline = rollouts.column("is_baseline").to_pylist() if "is_baseline" in names else None
        groups, scores = col["group_id"], rewards.column("score").to_pylist()
        rows = [i for i in range(rollouts.num_rows) if not (baseline and baseline[i])]
        baseline_scores = None
        if baseline is not None and any(baseline):
            by_group: dict[int, float] = {}
            for i in (i for i in range(rollouts.num_rows) if baseline[i]):
                if groups[i] in by_group:
                    raise ValueError(f"prompt group {groups[i]} has more than one baseline (is_baseline) row")
                by_group[groups[i]] = scores[i]
            missing = sorted({groups[i] for i in rows} - by_group.keys())
            if missing:
                raise ValueError(f"no baseline (is_baseline) row for prompt group(s) {missing[:5]}")
            baseline_scores = torch.tensor([by_group[groups[i]] for i in rows], dtype=torch.float32)
        r_max = max((len(col["response_ids"][i]) for i in rows), default=0)
        behaviour = torch.zeros(len(rows), max(r_max, 1))  # (S, R)
        # multi-turn rows: 1 on model tokens, 0 on tool tokens; null (single-turn): every token
        masks = (
            rollouts.column("loss_mask").to_pylist() if "loss_mask" in names else [None] * rollouts.num_rows
        )
        loss_mask = torch.zeros(len(rows), max(r_max, 1))  # (S, R)
        for s, i in enumerate(rows):
            lp, n = col["logprobs"][i], len(col["response_ids"][i])
            if len(lp) != n:
                raise ValueError(f"rollout row {i}: {len(lp)} logprobs for {n} response tokens")
            behaviour[s, :n] = torch.tensor(lp, dtype=torch.float32)
            m = masks[i]
            if m is not None and len(m) != n:
                raise ValueError(f"rollout row {i}: loss_mask of {len(m)} tokens for {n} response tokens")
            loss_mask[s, :n] = 1.0 if m is None else torch.tensor(m, dtype=torch.float32)
        return cls(
            prompt_ids=[col["prompt_ids"][i] for i in rows],
            response_ids=[col["response_ids"][i] for i in rows],
            group_ids=torch.tensor([groups[i] for i in rows], dtype=torch.long),
            sample_index=torch.tensor([col["sample_index"][i] for i in rows], dtype=torch.long),
            scores=torch.tensor([scores[i] for i in rows], dtype=torch.float32),
            behaviour_log_probs=behaviour,
            loss_mask=loss_mask if any(m is not None for m in masks) else None,
            baseline_scores=baseline_scores,
        )


_BATCH_COLUMNS = ("group_id", "sample_index", "prompt_ids", "response_ids", "logprobs")


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
class RolloutCorrectionSpec:
    """Rollout/trainer mismatch correction (:mod:`verl_core.algorithms.rollout_correction`); the
    defaults are off: metrics only."""

    rollout_is: str | None = None  # TIS weight level: token | sequence
    rollout_is_threshold: float = 2.0  # truncation C of the weights
    rollout_rs: str | None = None  # rejection level: token | sequence | geometric
    rollout_rs_threshold: float = 2.0  # rejected above
    rollout_rs_threshold_lower: float | None = None  # rejected below (None: 1 / rollout_rs_threshold)
    log_prob_diff_threshold: float = 0.1  # |Δ log-prob| counted by log_prob_abs_diff_frac_above

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None


@dataclass(frozen=True)
class PPOSpec:
    """Every setting of one iteration (the stage builds it from the config)."""

    actor: ActorLossSpec
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    actor_epochs: int = 1
    actor_mini_batch_groups: int = 1  # prompt groups per actor optimizer step
    critic_epochs: int = 1
    critic_mini_batch_groups: int = 1
    micro_batch_size: int | None = None  # samples per micro-batch; None: token budgets below
    actor_token_budget: int = 16384  # tokens per actor micro-batch
    critic_token_budget: int = 16384  # tokens per critic micro-batch (also the values forward)
    log_prob_token_budget: int = 16384  # old log-prob forward
    ref_token_budget: int = 16384  # reference log-prob forward
    cliprange_value: float = 0.5
    critic_loss_agg_mode: str = "token-mean"
    horizon: float = 1.0  # H of seq-mean-token-sum-norm: the maximum response length
    update_actor: bool = True  # False during critic warm-up
    use_rollout_logprobs: bool = False  # old log-probs = the engine's behaviour log-probs
    rollout_correction: RolloutCorrectionSpec = field(default_factory=RolloutCorrectionSpec)
    share_prompts: bool = True  # a micro-batch's samples of one prompt store it once (same math)


class PPOIterationResult(NamedTuple):
    """advantages, returns, kl: ``(S, R)`` per response token (kl None without KL in reward);
    metrics: means over the iteration, independent of micro-batching."""

    advantages: Tensor
    returns: Tensor
    kl: Tensor | None
    metrics: dict[str, float]


# the loss metrics are summed over the micro-batches of a mini-batch (each is its share of the
# mini-batch loss), then averaged over mini-batches; every other micro-batch metric is a token mean,
# combined weighted by the micro-batch's tokens
_LOSS_METRICS = frozenset({"actor/pg_loss", "actor/kl_loss", "critic/vf_loss"})


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
    log = _MetricLog()
    metrics = {**rewards.metrics, **corr.metrics}
    prompts = batch.prompt_ids if spec.share_prompts else None  # budgets count stored tokens
    if models.critic is not None and models.critic_engine is not None and values is not None:
        critic_loss_fn = partial(_critic_micro_loss, models.critic, batch, spec, values, adv.returns, log)
        with timed(timing, "update_critic"):
            for rows in minibatches(batch.group_ids, spec.critic_mini_batch_groups, spec.critic_epochs, seed):
                norm = _agg_norm(mask[rows], spec.horizon)  # the whole mini-batch, all ranks
                mbs = dp_micro_batches(
                    rows, batch.lengths, spec.critic_token_budget, dp, spec.micro_batch_size, prompts
                )
                stats = models.critic_engine.step(
                    mbs, partial(critic_loss_fn, norm, models.device), where=f"{where} critic"
                )
                log.step({"critic/grad_norm": stats.grad_norm})
        # 1 − Var(R − V)/Var(R) for the values the advantages used, once over the whole batch
        metrics["critic/vf_explained_var"] = float(explained_variance(values, adv.returns, mask))
    if spec.update_actor:
        actor_loss_fn = partial(
            _actor_micro_loss, models.actor, batch, spec, old_logp, adv.advantages, ref_logp, corr, log
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
                    mbs, partial(actor_loss_fn, norm, models.device, fill), where=f"{where} actor"
                )
                if fill is not None:
                    old_logp += sum_over_ranks(fill, dp)  # (S, R): the on-policy rows were 0
                log.step({"actor/grad_norm": stats.grad_norm, "actor/lr": stats.lr})
        if on_policy:
            metrics.update(_rollout_correction(batch, old_logp, mask, spec).metrics)

    metrics.update(log.means(dp))
    metrics.update(
        _batch_metrics(
            scores, rewards.token_rewards, adv.advantages, adv.returns, values, mask, batch.group_ids
        )
    )
    metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
    metrics["perf/throughput"] = sum(batch.lengths) * spec.actor_epochs / max(sum(timing.values()), 1e-9)
    return PPOIterationResult(adv.advantages, adv.returns, rewards.kl, metrics)


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
            old_logp = _forward(
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
            ref_logp = _forward(
                batch, device, spec.ref_token_budget, mask, dp,
                lambda b: response_log_probs(ref, b, temperature=temperature)[0],
                share_prompts=spec.share_prompts,
            )  # fmt: skip
    values = None
    if models.critic is not None:
        critic = models.critic
        with timed(timing, "values"):
            values = _forward(
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


def _actor_micro_loss(
    actor: PackedCausalLM,
    batch: RolloutBatch,
    spec: PPOSpec,
    old_logp: Tensor,
    advantages: Tensor,
    ref_logp: Tensor | None,
    corr: RolloutCorrection,
    log: _MetricLog,
    norm: AggNorm,
    device: torch.device,
    fill_old: Tensor | None,
    mb: MicroBatch,
) -> Tensor:
    """The actor loss share of micro-batch ``mb`` (× its weight: 0 for padding); per-token inputs
    ``(S, R)`` of the whole batch; the loss mask is the correction's (rejected tokens removed).
    ``fill_old (S, R)``: the policy is still θ_old (first step), so π_old = this forward's
    log-probs (detached), written there for the later steps; None: π_old from ``old_logp``."""
    rows = mb.rows
    b = batch.micro(rows, spec.share_prompts).to(device)
    r = b.response_mask.shape[1]
    b = b._replace(response_mask=corr.response_mask[rows, :r])
    ref = None if ref_logp is None else ref_logp[rows, :r]
    weights = None if corr.weights is None else corr.weights[rows, :r]
    old = None if fill_old is not None else old_logp[rows, :r]
    out = actor_loss(actor, b, old, advantages[rows, :r], ref, spec.actor, norm, weights)
    if fill_old is not None and mb.weight:
        fill_old[rows, :r] = out.log_probs
    log.micro(out.metrics, float(b.response_mask.sum()), mb.weight)
    return out.loss * mb.weight


def _critic_micro_loss(
    critic: PackedScoreModel,
    batch: RolloutBatch,
    spec: PPOSpec,
    old_values: Tensor,
    returns: Tensor,
    log: _MetricLog,
    norm: AggNorm,
    device: torch.device,
    mb: MicroBatch,
) -> Tensor:
    """The critic loss share of micro-batch ``mb`` (× its weight: 0 for padding); per-token inputs
    ``(S, R)`` of the whole batch."""
    rows = mb.rows
    b = batch.micro(rows, spec.share_prompts).to(device)
    r = b.response_mask.shape[1]
    loss, metrics = critic_loss(
        critic,
        b,
        old_values[rows, :r],
        returns[rows, :r],
        cliprange_value=spec.cliprange_value,
        loss_agg_mode=spec.critic_loss_agg_mode,
        norm=norm,
    )
    log.micro(metrics, float(b.response_mask.sum()), mb.weight)
    return loss * mb.weight


class _MetricLog:
    """Micro-batch metrics → iteration means that do not depend on how mini-batches are split, nor
    on how they are shared among data-parallel ranks.

    Per rank: the loss shares of each mini-batch (summed), Σ value·tokens and Σ tokens of every
    token-mean metric; :meth:`means` sums them over the ranks (one all-reduce) and divides. A padding
    micro-batch (weight 0) records zeros, so every rank holds the same keys and step counts."""

    def __init__(self) -> None:
        self.losses: dict[str, float] = defaultdict(float)  # current mini-batch's loss sums (this rank)
        self.step_losses: dict[str, list[float]] = defaultdict(list)  # per step, summed over ranks later
        self.per_step: dict[str, list[float]] = defaultdict(list)  # per step, already global
        self.weighted: dict[str, float] = defaultdict(float)  # Σ value·tokens
        self.tokens: dict[str, float] = defaultdict(float)  # Σ tokens

    def micro(self, metrics: dict[str, float], tokens: float, weight: float = 1.0) -> None:
        for k, v in metrics.items():
            if k in _LOSS_METRICS:
                self.losses[k] += v * weight
            else:
                self.weighted[k] += v * tokens * weight
                self.tokens[k] += tokens * weight

    def step(self, metrics: dict[str, float]) -> None:
        """End of a mini-batch (one optimizer step): its loss sums become one value each; ``metrics``
        (grad norm, lr) are the same on every rank."""
        for k, v in self.losses.items():
            self.step_losses[k].append(v)
        for k, v in metrics.items():
            self.per_step[k].append(v)
        self.losses.clear()

    def means(self, dp: DPView) -> dict[str, float]:
        losses, weighted = sorted(self.step_losses), sorted(self.weighted)
        flat = [v for k in losses for v in self.step_losses[k]]
        flat += [self.weighted[k] for k in weighted] + [self.tokens[k] for k in weighted]
        summed = sum_over_ranks(torch.tensor(flat, dtype=torch.float64), dp).tolist()
        out = {k: sum(v) / len(v) for k, v in self.per_step.items() if v}
        at = 0
        for k in losses:  # each step's loss: Σ over ranks of the rank's shares
            n = len(self.step_losses[k])
            out[k] = sum(summed[at : at + n]) / n
            at += n
        num, den = summed[at : at + len(weighted)], summed[at + len(weighted) :]
        out.update({k: a / b for k, a, b in zip(weighted, num, den, strict=True) if b > 0})
        return out


def minibatches(group_ids: Tensor, groups_per_minibatch: int, epochs: int, seed: int) -> list[list[int]]:
    """Sample rows of each mini-batch, in order: whole prompt groups, the group order reshuffled every
    epoch (epoch e draws from a generator seeded ``derive_seed("minibatch", seed, e)``)."""
    by_group: dict[int, list[int]] = defaultdict(list)
    for row, g in enumerate(group_ids.tolist()):
        by_group[g].append(row)
    groups = sorted(by_group)
    out = []
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(derive_seed("minibatch", seed, epoch))
        order = torch.randperm(len(groups), generator=g).tolist()
        for k in range(0, len(order), groups_per_minibatch):
            out.append([row for i in order[k : k + groups_per_minibatch] for row in by_group[groups[i]]])
    return out


@torch.no_grad()
def _forward(
    batch: RolloutBatch,
    device: torch.device,
    budget: int,
    mask: Tensor,
    dp: DPView,
    fn: Callable[[PPOBatch], Tensor],
    rows: Sequence[int] | None = None,
    share_prompts: bool = False,
) -> Tensor:
    """``fn`` over token-budget micro-batches of this rank's share of ``rows`` (None: every sample;
    padded to the count every rank runs; a padding result is dropped), gathered from all ranks into
    ``(S, R)`` (zeros on the rows not asked for)."""
    out = torch.zeros_like(mask)  # (S, R): this rank's rows filled, zeros elsewhere
    todo = range(len(batch)) if rows is None else rows
    if not todo:
        return out  # every rank skips alike (rows are the same on every rank): no collective
    prompts = batch.prompt_ids if share_prompts else None  # budgets count stored tokens
    for mb in dp_micro_batches(todo, batch.lengths, budget, dp, prompts=prompts):
        value = fn(batch.micro(mb.rows, share_prompts).to(device))  # (B, R_mb)
        if mb.weight:
            out[mb.rows, : value.shape[1]] = value.float()
    return sum_over_ranks(out, dp)


def _agg_norm(mask: Tensor, horizon: float) -> AggNorm:
    """Loss denominators of a whole mini-batch ``mask (B, R)``: its response tokens and sequences."""
    return AggNorm(num_tokens=float(mask.sum()), num_seqs=float(mask.shape[0]), horizon=horizon)


def _check_finite(tensors: dict[str, Tensor], where: str) -> None:
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise NonFiniteError(f"{where}: {name} contains NaN/Inf (before any optimizer step)")


def _batch_metrics(
    scores: Tensor,
    token_scores: Tensor,
    adv: Tensor,
    returns: Tensor,
    values: Tensor | None,
    mask: Tensor,
    group_ids: Tensor,
) -> dict[str, float]:
    """verl's data metrics (``critic/...``) of the whole batch, plus two that say why a run is flat:
    ``critic/advantages/abs_mean`` (mean |Â_t| over response tokens: how hard the batch pushes) and
    ``batch/zero_variance_groups`` (share of the prompt groups of two or more samples whose outcome
    scores are all equal: a group-relative estimator gives them zero advantage; absent without such
    groups). ``scores`` (S,), ``token_scores``/``adv``/``returns``/``values``/``mask`` (S, R),
    ``group_ids`` (S,)."""
    seq_rewards = (token_scores * mask).sum(-1)  # (S,)
    out = {
        "critic/score/mean": float(scores.mean()),
        "critic/rewards/mean": float(seq_rewards.mean()),
        "critic/advantages/mean": float(masked_mean(adv, mask)),
        "critic/advantages/abs_mean": float(masked_mean(adv.abs(), mask)),
        "critic/advantages/max": float(adv[mask.bool()].max()) if mask.any() else 0.0,
        "critic/returns/mean": float(masked_mean(returns, mask)),
        "response_length/mean": float(mask.sum(-1).mean()),
    }
    if values is not None:
        out["critic/values/mean"] = float(masked_mean(values, mask))
    zero_variance = _zero_variance_share(scores, group_ids.to(scores.device))
    if zero_variance is not None:
        out["batch/zero_variance_groups"] = zero_variance
    return out


def _zero_variance_share(scores: Tensor, group_ids: Tensor) -> float | None:
    """Share of the groups of ≥ 2 samples whose ``scores`` (S,) are all equal (max = min), groups by
    ``group_ids`` (S,); None when no group has two samples."""
    _, group = torch.unique(group_ids, return_inverse=True)  # (S,) in 0..G-1
    size = torch.bincount(group)  # (G,)
    hi = torch.full(size.shape, -torch.inf, dtype=scores.dtype, device=scores.device)
    lo = torch.full(size.shape, torch.inf, dtype=scores.dtype, device=scores.device)
    hi = hi.scatter_reduce(0, group, scores, reduce="amax")  # (G,) max score of each group
    lo = lo.scatter_reduce(0, group, scores, reduce="amin")  # (G,) min score of each group
    several = size >= 2
    if not several.any():
        return None
    return float(((hi == lo) & several).sum() / several.sum())
