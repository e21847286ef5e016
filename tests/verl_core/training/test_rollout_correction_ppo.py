"""ppo_iteration with rollout correction: no gap changes nothing, truncated weights scale the gradient,
a rejected sequence leaves the update like a masked one, the mismatch metrics, the config wiring."""

from __future__ import annotations

import math

import pytest
import torch

from stages.floor.specs import ppo_spec
from tests.verl_core.training.specs import correction_spec
from tests.verl_core.training.test_ppo_iteration import (
    PROMPTS,
    RESPONSES,
    make_batch,
    make_models,
    make_spec,
    record_gradients,
    run,
    weights,
)
from verl_core.algorithms.rollout_correction import RolloutCorrectionSpec
from verl_core.config import load_config
from verl_core.training.ppo_kernels import response_log_probs

N_TOKENS = sum(len(r) for r in RESPONSES)  # 13 response tokens


def old_log_probs() -> torch.Tensor:
    """``(6, 4)`` the recomputed π_old of the start weights (what ppo_iteration computes first)."""
    with torch.no_grad():
        return response_log_probs(make_models().actor, make_batch().micro(range(len(PROMPTS))))[0]


def test_no_gap_with_correction_on_changes_nothing() -> None:
    a, b = make_models(), make_models()
    run(a, make_spec())
    corr = correction_spec(rollout_is="token", rollout_rs="token", rollout_rs_threshold=1.5)
    result = run(b, make_spec(rollout_correction=corr), make_batch(behaviour_log_probs=old_log_probs()))
    wa, wb = weights(a.actor), weights(b.actor)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=0.0, rtol=0.0)
    m = result.metrics
    assert m["rollout_corr/kl"] == 0.0 and m["rollout_corr/log_prob_abs_diff_max"] == 0.0
    assert m["rollout_corr/rollout_is_mean"] == 1.0
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0


def test_mismatch_metrics_are_logged_without_correction() -> None:
    # π_beh = π_old / 2 on every token: log w = ln 2, k1 = mean(log π_beh − log π_old) = −ln 2
    behaviour = old_log_probs() - math.log(2.0)
    m = run(make_models(), make_spec(), make_batch(behaviour_log_probs=behaviour)).metrics
    assert m["rollout_corr/kl"] == pytest.approx(-math.log(2.0), abs=1e-6)
    assert m["rollout_corr/k3_kl"] == pytest.approx(2.0 - 1.0 - math.log(2.0), abs=1e-6)  # r − 1 − ln r
    assert m["rollout_corr/log_prob_abs_diff_max"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert m["rollout_corr/log_prob_abs_diff_frac_above"] == 1.0  # ln 2 > 0.1 on all 13 tokens
    assert "rollout_corr/rollout_is_mean" not in m  # correction off: metrics only


def test_truncated_weights_scale_the_gradient() -> None:
    # w = 2 on every token, truncated at C = 1.5: every token loss × 1.5, so (token-mean) the first
    # step's gradient is 1.5 × the uncorrected one
    spec = make_spec(actor_epochs=1)
    plain = make_models()
    plain_grads = record_gradients(plain.actor_engine)
    run(plain, spec)
    corrected = make_models()
    corrected_grads = record_gradients(corrected.actor_engine)
    corr = correction_spec(rollout_is="token", rollout_is_threshold=1.5)
    behaviour = old_log_probs() - math.log(2.0)
    result = run(
        corrected,
        make_spec(actor_epochs=1, rollout_correction=corr),
        make_batch(behaviour_log_probs=behaviour),
    )
    for g, p in zip(corrected_grads[0], plain_grads[0], strict=True):
        torch.testing.assert_close(g, 1.5 * p, atol=1e-7, rtol=1e-4)
    m = result.metrics
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(2.0, abs=1e-5)  # before truncation
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0


def test_a_rejected_sequence_is_left_out_like_a_masked_one() -> None:
    # ReMax advantages are per sample, so rejecting sample 3 (sequence weight 2^4 = 16 > 2) must give
    # exactly the update of the batch whose loss mask drops sample 3 (denominators included)
    baseline = torch.tensor([0.25, 0.25, 0.75, 0.75, 0.5, 0.5])
    spec = make_spec(adv_estimator="remax", actor_epochs=1, actor_mini_batch_groups=3)
    behaviour = old_log_probs()
    behaviour[3, :4] -= math.log(2.0)  # 4 tokens of sample 3, each w = 2
    rejected = make_models()
    rejected_grads = record_gradients(rejected.actor_engine)
    corr = correction_spec(rollout_rs="sequence", rollout_rs_threshold=2.0)
    result = run(
        rejected,
        make_spec(adv_estimator="remax", actor_epochs=1, actor_mini_batch_groups=3, rollout_correction=corr),
        make_batch(behaviour_log_probs=behaviour, baseline_scores=baseline),
    )
    mask = torch.ones(6, 4)
    mask[3] = 0.0
    masked = make_models()
    masked_grads = record_gradients(masked.actor_engine)
    run(masked, spec, make_batch(loss_mask=mask, baseline_scores=baseline))
    for g, w in zip(rejected_grads[0], masked_grads[0], strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)
    m = result.metrics
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / N_TOKENS)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 6)


def test_correction_needs_recomputed_old_log_probs() -> None:
    corr = correction_spec(rollout_is="token")
    batch = make_batch(behaviour_log_probs=old_log_probs())
    with pytest.raises(ValueError, match="not use_rollout_logprobs"):
        run(make_models(), make_spec(use_rollout_logprobs=True, rollout_correction=corr), batch)


def test_ppo_spec_carries_the_config() -> None:
    cfg = load_config(
        None,
        [
            "algorithm.rollout_correction.rollout_is=sequence",
            "algorithm.rollout_correction.rollout_is_threshold=3.0",
            "algorithm.rollout_correction.rollout_rs=geometric",
            "algorithm.rollout_correction.rollout_rs_threshold_lower=0.9",
        ],
    )
    assert ppo_spec(cfg, 0).rollout_correction == RolloutCorrectionSpec(
        rollout_is="sequence",
        rollout_is_threshold=3.0,
        rollout_rs="geometric",
        rollout_rs_threshold=2.0,
        rollout_rs_threshold_lower=0.9,
        log_prob_diff_threshold=0.1,
    )
    assert not ppo_spec(load_config(None, []), 0).rollout_correction.enabled
