"""Keys whose only tests were config checks, followed to the update's spec that carries them (the
log-prob and reference token budgets, the KL-in-reward estimator)."""

from __future__ import annotations

from stages.floor.specs import ppo_spec
from verl_core.config import load_config


def test_log_prob_budgets_and_kl_penalty_reach_the_update() -> None:
    cfg = load_config(
        None,
        [
            "rollout.log_prob_max_token_len_per_gpu=1000",
            "ref.log_prob_max_token_len_per_gpu=2000",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=low_var_kl",
        ],
    )
    spec = ppo_spec(cfg, 0)
    assert (spec.log_prob_token_budget, spec.ref_token_budget) == (1000, 2000)
    assert spec.kl_penalty == "low_var_kl" and spec.use_kl_in_reward is True
