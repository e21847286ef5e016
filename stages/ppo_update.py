"""PPO / GRPO update stage: rollouts + rewards → advantages → critic and actor optimizer steps.

Writes ``iter-XXXX/update/update.parquet`` (per-sample score, advantages, returns, KL) and moves the
in-memory policy from version i to i+1. The new weights live in memory until the next checkpoint
(every ``trainer.save_freq`` iterations), so the stage's manifest is sealed, not published: the
checkpoint that makes the weights durable publishes it (see :mod:`stages.rl_state`). A committed
update is therefore always covered by a checkpoint and never runs again; an uncommitted one is re-run
after a crash, and being deterministic writes the same table.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import torch
from prefect import task
from torch import Tensor

from stages.floor.locations import iteration_stage
from stages.floor.state import RLState, get_state
from verl_core.algorithms import agg_norm_for, apply_kl_penalty, get_adv_estimator, masked_mean
from verl_core.config import VerlFlowConfig
from verl_core.data.packing import dynamic_micro_batches
from verl_core.run import RunContext
from verl_core.training.engine import NonFiniteError
from verl_core.training.ppo import (
    ActorLossSpec,
    PPOBatch,
    actor_loss,
    critic_loss,
    make_ppo_batch,
    response_log_probs,
    response_values,
    token_rewards,
)


@task(name="ppo_update")
def ppo_update(
    ctx: RunContext, cfg: VerlFlowConfig, rollout_uri: str, reward_uri: str, iteration: int
) -> str:
    """One PPO/GRPO iteration's update; returns the stage's manifest URI."""
    store, state = ctx.store(), get_state(ctx)
    # 1. Skip only when the policy in memory already includes this update
    params = {k: getattr(cfg, k).model_dump(mode="json") for k in ("actor", "critic", "algorithm", "model")}
    stage = store.open_stage(
        ctx.run_id,
        iteration_stage(iteration, "update"),
        params={"iteration": iteration, **params},
        inputs={"rollout": rollout_uri, "reward": reward_uri},
        force=state.version == iteration,
    )
    if stage.done:
        return stage.manifest_uri
    if state.version != iteration:
        raise RuntimeError(
            f"update of iteration {iteration} needs policy version {iteration}, have {state.version}"
        )
    timing: dict[str, float] = {}

    # 2. Read rollouts and rewards; pack every sample
    rollouts = store.read_table(store.read_manifest(rollout_uri), "rollouts.parquet")
    rewards = store.read_table(store.read_manifest(reward_uri), "rewards.parquet")
    prompts = rollouts.column("prompt_ids").to_pylist()
    responses = rollouts.column("response_ids").to_pylist()
    full = make_ppo_batch(prompts, responses)
    mask = full.response_mask.to(state.device)  # (S, R)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]

    # 3. Old log-probs, reference log-probs, values (no grad)
    with _timer(timing, "old_log_prob"):
        if cfg.actor.use_rollout_logprobs:
            old_logp = _pad_lists(rollouts.column("logprobs").to_pylist(), mask)
        else:
            old_logp = old_log_probs(state, cfg, prompts, responses, lengths, mask)
    ref_logp = None
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        with _timer(timing, "ref"):
            ref_logp = ref_log_probs(state, cfg, prompts, responses, lengths, mask)
    values = None
    if state.critic is not None:
        with _timer(timing, "values"):
            critic = state.critic
            v_budget = cfg.critic.ppo_max_token_len_per_gpu
            values = _forward(
                state, prompts, responses, lengths, v_budget, mask, lambda b: response_values(critic, b)
            )

    # 4. Token-level rewards (outcome score on the last token, KL in reward) and advantages
    with _timer(timing, "adv"):
        scores = torch.tensor(rewards.column("score").to_pylist(), dtype=torch.float32, device=state.device)
        token_scores = token_rewards(scores, mask)
        kl_tokens, metrics = None, {}
        if cfg.algorithm.use_kl_in_reward:
            assert ref_logp is not None
            pen = apply_kl_penalty(
                token_level_scores=token_scores,
                old_log_prob=old_logp,
                ref_log_prob=ref_logp,
                response_mask=mask,
                kl_coef=state.kl_ctrl.value,
                kl_penalty=cfg.algorithm.kl_penalty,
            )
            token_scores, kl_tokens = pen.token_level_rewards, pen.kl
            metrics.update(
                {
                    "actor/reward_kl_penalty": float(pen.stats.kl),
                    "actor/reward_kl_penalty_coeff": pen.stats.kl_coef,
                }
            )
            state.kl_ctrl.update(float(pen.stats.kl), n_steps=len(scores))
        groups = torch.tensor(rollouts.column("group_id").to_pylist(), device=state.device)
        adv = get_adv_estimator(cfg.algorithm.adv_estimator)(
            token_level_rewards=token_scores,
            response_mask=mask,
            index=groups,
            values=values,
            gamma=cfg.algorithm.gamma,
            lam=cfg.algorithm.lam,
            norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
        )
        finite = {"scores": scores, "advantages": adv.advantages, "returns": adv.returns}
        _check_finite({**finite, "old_log_probs": old_logp}, iteration)

    # 5. Critic, then actor: ppo_epochs passes over mini-batches of whole prompt groups
    group_ids = rollouts.column("group_id").to_pylist()
    a, c = cfg.actor, cfg.critic
    fixed = None if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu
    horizon = float(cfg.data.max_response_length)
    step_metrics: dict[str, list[float]] = defaultdict(list)
    if state.critic is not None and state.critic_engine is not None and values is not None:
        with _timer(timing, "update_critic"):
            for rows in _minibatches(
                group_ids, c.ppo_mini_batch_size, c.ppo_epochs, cfg.trainer.seed + iteration
            ):
                norm = agg_norm_for(mask[rows], horizon=horizon)
                stats = state.critic_engine.step(
                    _micro(rows, lengths, c.ppo_max_token_len_per_gpu, fixed),
                    _critic_loss_fn(state, cfg, prompts, responses, values, adv.returns, norm, step_metrics),
                    where=f"ppo_update iteration {iteration} critic",
                )
                step_metrics["critic/grad_norm"].append(stats.grad_norm)
    if iteration >= cfg.trainer.critic_warmup:
        with _timer(timing, "update_actor"):
            spec = _actor_spec(cfg)
            for rows in _minibatches(
                group_ids, a.ppo_mini_batch_size, a.ppo_epochs, cfg.trainer.seed + iteration
            ):
                norm = agg_norm_for(mask[rows], horizon=horizon)
                stats = state.actor_engine.step(
                    _micro(rows, lengths, a.ppo_max_token_len_per_gpu, fixed),
                    _actor_loss_fn(
                        state,
                        spec,
                        prompts,
                        responses,
                        old_logp,
                        adv.advantages,
                        ref_logp,
                        norm,
                        step_metrics,
                    ),
                    where=f"ppo_update iteration {iteration} actor",
                )
                step_metrics["actor/grad_norm"].append(stats.grad_norm)
                step_metrics["actor/lr"].append(stats.lr)

    # 6. Write the per-sample table, log metrics, advance the policy version; the next checkpoint commits
    stage.write_table(
        "update.parquet",
        _update_table(rollouts, scores, adv.advantages, adv.returns, kl_tokens, mask),
        "update",
    )
    metrics.update({k: sum(v) / len(v) for k, v in step_metrics.items() if v})
    metrics.update(_batch_metrics(scores, token_scores, adv.advantages, adv.returns, values, mask))
    metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
    metrics["perf/throughput"] = sum(lengths) * cfg.actor.ppo_epochs / max(sum(timing.values()), 1e-9)
    state.version = iteration + 1
    summary = {"policy_version": state.version, **{k: metrics[k] for k in sorted(metrics)}}
    state.pending.append(stage.seal(summary))  # published by the next checkpoint
    ctx.tracker().log_metrics(metrics, step=iteration)
    return stage.manifest_uri


class _timer:
    def __init__(self, into: dict[str, float], name: str) -> None:
        self.into, self.name = into, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.into[self.name] = self.into.get(self.name, 0.0) + time.perf_counter() - self.t0


def _micro(
    rows: Sequence[int], lengths: Sequence[int], budget: int, fixed: int | None = None
) -> list[list[int]]:
    """Micro-batches (lists of sample rows) of one mini-batch: token-budget ones (verl's
    ``use_dynamic_bsz``), or ``fixed`` samples each."""
    if fixed is not None:
        return [list(rows[i : i + fixed]) for i in range(0, len(rows), fixed)]
    parts = dynamic_micro_batches([lengths[r] for r in rows], max(budget, max(lengths[r] for r in rows)))
    return [[rows[i] for i in p] for p in parts]


def _mb(
    state: RLState, prompts: list[list[int]], responses: list[list[int]], rows: Sequence[int]
) -> PPOBatch:
    return make_ppo_batch([prompts[r] for r in rows], [responses[r] for r in rows]).to(state.device)


@torch.no_grad()
def _forward(
    state: RLState,
    prompts: list[list[int]],
    responses: list[list[int]],
    lengths: list[int],
    budget: int,
    mask: Tensor,
    fn: Callable[[PPOBatch], Tensor],
) -> Tensor:
    """``fn`` over token-budget micro-batches of all samples, gathered into ``(S, R)``."""
    out = torch.zeros_like(mask)
    for rows in _micro(list(range(len(prompts))), lengths, budget):
        value = fn(_mb(state, prompts, responses, rows))
        out[rows, : value.shape[1]] = value.float()
    return out


def old_log_probs(
    state: RLState,
    cfg: VerlFlowConfig,
    prompts: list[list[int]],
    responses: list[list[int]],
    lengths: list[int],
    mask: Tensor,
) -> Tensor:
    """``(S, R)`` log-probs of the responses under the current actor (no grad, rollout temperature)."""
    temp = cfg.rollout.temperature or 1.0
    budget = cfg.rollout.log_prob_max_token_len_per_gpu
    return _forward(
        state,
        prompts,
        responses,
        lengths,
        budget,
        mask,
        lambda b: response_log_probs(state.actor, b, temperature=temp)[0],
    )


def ref_log_probs(
    state: RLState,
    cfg: VerlFlowConfig,
    prompts: list[list[int]],
    responses: list[list[int]],
    lengths: list[int],
    mask: Tensor,
) -> Tensor:
    """``(S, R)`` log-probs under the reference (the frozen start policy; LoRA: adapters disabled)."""
    temp = cfg.rollout.temperature or 1.0
    budget = cfg.ref.log_prob_max_token_len_per_gpu
    return _forward(state, prompts, responses, lengths, budget, mask, _ref_fn(state, temp))


def _ref_fn(state: RLState, temp: float) -> Callable[[PPOBatch], Tensor]:
    def ref(batch: PPOBatch) -> Tensor:
        if state.ref is not None:
            return response_log_probs(state.ref, batch, temperature=temp)[0]
        with state.lm.disable_adapter():  # type: ignore[operator]  # LoRA: the base is the reference
            return response_log_probs(state.actor, batch, temperature=temp)[0]

    return ref


def _minibatches(group_ids: list[int], groups_per_minibatch: int, epochs: int, seed: int) -> list[list[int]]:
    """Sample rows of each mini-batch: whole prompt groups, group order reshuffled every epoch."""
    by_group: dict[int, list[int]] = defaultdict(list)
    for row, g in enumerate(group_ids):
        by_group[g].append(row)
    groups = sorted(by_group)
    out = []
    for epoch in range(epochs):
        order = torch.randperm(
            len(groups), generator=torch.Generator().manual_seed(seed * 7919 + epoch)
        ).tolist()
        for k in range(0, len(order), groups_per_minibatch):
            out.append([row for i in order[k : k + groups_per_minibatch] for row in by_group[groups[i]]])
    return out


def _actor_spec(cfg: VerlFlowConfig) -> ActorLossSpec:
    a = cfg.actor
    return ActorLossSpec(
        policy_loss=a.policy_loss,
        loss_agg_mode=a.loss_agg_mode,
        clip_ratio_low=a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        entropy_coeff=a.entropy_coeff,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        temperature=cfg.rollout.temperature or 1.0,
    )


def _actor_loss_fn(
    state: RLState,
    spec: ActorLossSpec,
    prompts: list[list[int]],
    responses: list[list[int]],
    old: Tensor,
    adv: Tensor,
    ref: Tensor | None,
    norm: Any,
    sink: dict[str, list[float]],
) -> Callable[[list[int]], Tensor]:
    def loss(rows: list[int]) -> Tensor:
        b = _mb(state, prompts, responses, rows)
        r = b.response_mask.shape[1]
        value, metrics = actor_loss(
            state.actor, b, old[rows, :r], adv[rows, :r], None if ref is None else ref[rows, :r], spec, norm
        )
        for k, v in metrics.items():
            sink[k].append(v)
        return value

    return loss


def _critic_loss_fn(
    state: RLState,
    cfg: VerlFlowConfig,
    prompts: list[list[int]],
    responses: list[list[int]],
    old_values: Tensor,
    returns: Tensor,
    norm: Any,
    sink: dict[str, list[float]],
) -> Callable[[list[int]], Tensor]:
    assert state.critic is not None
    critic = state.critic

    def loss(rows: list[int]) -> Tensor:
        b = _mb(state, prompts, responses, rows)
        r = b.response_mask.shape[1]
        value, metrics = critic_loss(
            critic,
            b,
            old_values[rows, :r],
            returns[rows, :r],
            cliprange_value=cfg.critic.cliprange_value,
            loss_agg_mode=cfg.critic.loss_agg_mode,
            norm=norm,
        )
        for k, v in metrics.items():
            sink[k].append(v)
        return value

    return loss


def _pad_lists(values: list[list[float]], mask: Tensor) -> Tensor:
    out = torch.zeros_like(mask)
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.tensor(v, dtype=out.dtype)
    return out


def _check_finite(tensors: dict[str, Tensor], iteration: int) -> None:
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise NonFiniteError(
                f"ppo_update: iteration {iteration}: {name} contains NaN/Inf (before any optimizer step)"
            )


def _batch_metrics(
    scores: Tensor, token_scores: Tensor, adv: Tensor, returns: Tensor, values: Tensor | None, mask: Tensor
) -> dict[str, float]:
    seq_rewards = (token_scores * mask).sum(-1)
    out = {
        "critic/score/mean": float(scores.mean()),
        "critic/rewards/mean": float(seq_rewards.mean()),
        "critic/advantages/mean": float(masked_mean(adv, mask)),
        "critic/advantages/max": float(adv[mask.bool()].max()) if mask.any() else 0.0,
        "critic/returns/mean": float(masked_mean(returns, mask)),
        "response_length/mean": float(mask.sum(-1).mean()),
    }
    if values is not None:
        out["critic/values/mean"] = float(masked_mean(values, mask))
    return out


def _update_table(
    rollouts: pa.Table, scores: Tensor, adv: Tensor, returns: Tensor, kl: Tensor | None, mask: Tensor
) -> pa.Table:
    lengths = mask.sum(-1).long().tolist()

    def rows(t: Tensor | None) -> list[list[float]]:
        if t is None:
            return [[] for _ in lengths]
        return [t[i, :n].tolist() for i, n in enumerate(lengths)]

    return pa.table(
        {
            "group_id": rollouts.column("group_id"),
            "sample_index": rollouts.column("sample_index"),
            "score": pa.array(scores.tolist(), pa.float32()),
            "advantages": pa.array(rows(adv), pa.list_(pa.float32())),
            "returns": pa.array(rows(returns), pa.list_(pa.float32())),
            "kl": pa.array(rows(kl), pa.list_(pa.float32())),
        }
    )
