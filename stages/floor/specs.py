"""The RL loop's plan and update settings from the config: how many iterations a run plans (and why
fewer than asked), the actor's and critic's optimizers and LR schedules, an iteration's PPO spec and
its mini-batch seed."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeVar

from verl_core.algorithms.rollout_correction import RolloutCorrectionSpec
from verl_core.config import VerlFlowConfig
from verl_core.runtime.run_length import StepCount
from verl_core.seeding import derive_seed
from verl_core.training.engine import OptimSpec
from verl_core.training.ppo import PPOSpec
from verl_core.training.ppo_kernels import ActorLossSpec


def planned_iterations(cfg: VerlFlowConfig, n_prompts: int) -> int:
    """RL iterations of the run: ``trainer.total_iterations``, capped by ``trainer.total_epochs`` passes
    over the ``n_prompts`` training prompts (each iteration takes ``data.train_batch_size`` of them)."""
    t = cfg.trainer
    return min(t.total_iterations, math.ceil(t.total_epochs * n_prompts / cfg.data.train_batch_size))


def iteration_count(cfg: VerlFlowConfig, planned: int, completed: int) -> StepCount:
    """The RL loop's :class:`StepCount`: ``planned`` from :func:`planned_iterations`, the reason when
    it is below ``trainer.total_iterations`` (the epoch cap, the only one)."""
    t = cfg.trainer
    cap = None
    if planned < t.total_iterations:
        cap = f"trainer.total_epochs={t.total_epochs} passes over the training prompts"
    return StepCount(
        unit="RL iterations", requested=t.total_iterations, planned=planned, completed=completed, cap=cap
    )


def optim_spec(
    *, lr: float, weight_decay: float, grad_clip: float, total_steps: int, warmup_ratio: float, scheduler: str
) -> OptimSpec:
    """AdamW and its LR schedule over ``total_steps`` optimizer steps, the first
    ``int(warmup_ratio · total_steps)`` of them a linear warm-up (the actor, the critic and SFT)."""
    return OptimSpec(
        lr=lr,
        weight_decay=weight_decay,
        warmup_steps=int(warmup_ratio * total_steps),
        total_steps=total_steps,
        scheduler=scheduler,
        grad_clip=grad_clip,
    )


def actor_spec(cfg: VerlFlowConfig, iterations: int) -> OptimSpec:
    """The actor's optimizer and LR schedule over ``iterations`` RL iterations
    (``actor.ppo_epochs`` × mini-batches optimizer steps each)."""
    a = cfg.actor
    total = iterations * a.ppo_epochs * (cfg.data.train_batch_size // a.ppo_mini_batch_size)
    return optim_spec(
        lr=a.lr, weight_decay=a.weight_decay, grad_clip=a.grad_clip, total_steps=total,
        warmup_ratio=a.warmup_steps_ratio, scheduler=a.lr_scheduler,
    )  # fmt: skip


def critic_spec(cfg: VerlFlowConfig, iterations: int) -> OptimSpec:
    """The critic's optimizer over ``iterations`` RL iterations (constant LR)."""
    c = cfg.critic
    total = iterations * c.ppo_epochs * (cfg.data.train_batch_size // c.ppo_mini_batch_size)
    return optim_spec(
        lr=c.lr, weight_decay=c.weight_decay, grad_clip=c.grad_clip, total_steps=total,
        warmup_ratio=0.0, scheduler="constant",
    )  # fmt: skip


S = TypeVar("S")


def _spec_from(spec_type: type[S], section: Any, **others: Any) -> S:
    """``spec_type`` (a dataclass) from ``section``'s fields of the same names, and ``others``."""
    names = [f.name for f in dataclasses.fields(spec_type) if f.name not in others]  # type: ignore[arg-type]
    return spec_type(**{n: getattr(section, n) for n in names}, **others)


def ppo_spec(cfg: VerlFlowConfig, iteration: int) -> PPOSpec:
    """The settings of iteration ``iteration``'s update (the actor waits out ``trainer.critic_warmup``).
    Fields named as in ``actor`` and ``algorithm`` (and its ``rollout_correction``) come from there."""
    a, c, alg = cfg.actor, cfg.critic, cfg.algorithm
    actor = _spec_from(
        ActorLossSpec,
        a,
        loss_agg_mode=a.resolved_loss_agg_mode,
        clip_ratio_low=a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high,
        temperature=cfg.rollout.temperature or 1.0,
    )
    return _spec_from(
        PPOSpec,
        alg,
        actor=actor,
        actor_epochs=a.ppo_epochs,
        actor_mini_batch_groups=a.ppo_mini_batch_size,
        critic_epochs=c.ppo_epochs,
        critic_mini_batch_groups=c.ppo_mini_batch_size,
        share_prompts=cfg.model.share_prompts,
        micro_batch_size=None if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu,
        actor_token_budget=a.ppo_max_token_len_per_gpu,
        critic_token_budget=c.ppo_max_token_len_per_gpu,
        log_prob_token_budget=cfg.rollout.log_prob_max_token_len_per_gpu,
        ref_token_budget=cfg.ref.log_prob_max_token_len_per_gpu,
        cliprange_value=c.cliprange_value,
        critic_loss_agg_mode=c.loss_agg_mode,
        horizon=float(cfg.data.max_response_length),
        update_actor=iteration >= cfg.trainer.critic_warmup,
        use_rollout_logprobs=a.use_rollout_logprobs,
        rollout_correction=_spec_from(RolloutCorrectionSpec, alg.rollout_correction),
    )


def update_seed(cfg: VerlFlowConfig, iteration: int) -> int:
    """The seed of iteration ``iteration``'s mini-batch order (the update stage and the benchmarks)."""
    return derive_seed("ppo_update", cfg.trainer.seed, iteration)
