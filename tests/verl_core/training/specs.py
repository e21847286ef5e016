"""Complete specs for the training tests: the spec types have no defaults of their own (the config
schema holds those), so the tests name every value here once and override what a test is about."""

from __future__ import annotations

from verl_core.algorithms.rollout_correction import RolloutCorrectionSpec
from verl_core.training.ppo import PPOSpec
from verl_core.training.ppo_kernels import ActorLossSpec


def correction_spec(**kw: object) -> RolloutCorrectionSpec:
    """The rollout correction off (its mismatch metrics only), but for ``kw``."""
    base: dict[str, object] = {
        "rollout_is": None,
        "rollout_is_threshold": 2.0,
        "rollout_rs": None,
        "rollout_rs_threshold": 2.0,
        "rollout_rs_threshold_lower": None,
        "log_prob_diff_threshold": 0.1,
    }
    base.update(kw)
    return RolloutCorrectionSpec(**base)  # type: ignore[arg-type]


def ppo_spec(actor: ActorLossSpec, **kw: object) -> PPOSpec:
    """GRPO, one epoch of one-group mini-batches, token budgets of 16384, no KL in the reward, no
    rollout correction, but for ``kw``."""
    base: dict[str, object] = {
        "adv_estimator": "grpo",
        "gamma": 1.0,
        "lam": 1.0,
        "norm_adv_by_std_in_grpo": True,
        "use_kl_in_reward": False,
        "kl_penalty": "kl",
        "actor_epochs": 1,
        "actor_mini_batch_groups": 1,
        "critic_epochs": 1,
        "critic_mini_batch_groups": 1,
        "micro_batch_size": None,
        "actor_token_budget": 16384,
        "critic_token_budget": 16384,
        "log_prob_token_budget": 16384,
        "ref_token_budget": 16384,
        "cliprange_value": 0.5,
        "critic_loss_agg_mode": "token-mean",
        "horizon": 1.0,
        "update_actor": True,
        "use_rollout_logprobs": False,
        "rollout_correction": correction_spec(),
        "share_prompts": True,
    }
    base.update(kw)
    return PPOSpec(actor=actor, **base)  # type: ignore[arg-type]
