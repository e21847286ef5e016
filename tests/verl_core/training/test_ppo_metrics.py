"""The learning diagnostics of one PPO iteration: mean |advantage| and the share of prompt groups whose
samples all scored the same (a group-relative estimator gives them no signal)."""

from __future__ import annotations

import pytest
import torch

from tests.verl_core.training.test_ppo_iteration import make_batch, make_models, make_spec, run


def test_zero_variance_groups_and_mean_abs_advantage_by_hand() -> None:
    # groups 0 and 2 score alike ([1, 1], [0, 0]); group 1 does not ([0, 1])
    batch = make_batch(scores=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]))
    m = run(make_models(), make_spec(), batch).metrics
    assert m["batch/zero_variance_groups"] == pytest.approx(2 / 3)
    # GRPO: groups 0 and 2 get Â = 0; group 1: mean 0.5, unbiased std √0.5 → Â = ∓0.5/√0.5 = ∓0.7071
    # on every token of samples 2 (2 tokens) and 3 (4 tokens); 13 response tokens in all:
    # mean |Â| = 6 · 0.7071 / 13 = 0.3264, while the signed mean is (−2 + 4) · 0.7071 / 13 = 0.1088
    assert m["critic/advantages/abs_mean"] == pytest.approx(6 * 0.5**0.5 / 13, rel=1e-4)
    assert m["critic/advantages/mean"] == pytest.approx(2 * 0.5**0.5 / 13, rel=1e-4)


def test_every_group_varies_and_groups_of_one_have_no_share() -> None:
    # the default scores [1, 0 | 0, 1 | 0.5, 0]: every group varies
    assert run(make_models(), make_spec()).metrics["batch/zero_variance_groups"] == 0.0
    # one sample per prompt (PPO with rollout.n = 1): no group can vary, the metric is left out
    single = make_batch(group_ids=torch.arange(6), sample_index=torch.zeros(6, dtype=torch.long))
    m = run(make_models(), make_spec(adv_estimator="reinforce_plus_plus"), single).metrics
    assert "batch/zero_variance_groups" not in m
    assert m["critic/advantages/abs_mean"] > 0
