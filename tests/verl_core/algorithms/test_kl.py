"""KL estimators, straight-through variants, KL in the reward, controllers, KL loss."""

import math

import pytest
import torch

from verl_core.algorithms import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    get_kl_estimator,
    make_kl_controller,
)

F64 = torch.float64

# Three tokens (log π_θ, log π_ref):
#   A (−1, −2):  d = logp − ref = 1,  log r = ref − logp = −1
#   B (−2, −1):  d = −1,              log r = 1
#   C (−1, −31): d = 30,              log r = −30, clamped to −20
LOG_PROB = torch.tensor([-1.0, -2.0, -1.0], dtype=F64)
REF_LOG_PROB = torch.tensor([-2.0, -1.0, -31.0], dtype=F64)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("kl", [1.0, -1.0, 30.0]),  # k1 = d
        ("abs", [1.0, 1.0, 30.0]),  # |d|
        ("mse", [0.5, 0.5, 450.0]),  # ½ d²
        # k3 = e^{log r} − log r − 1: e^−1 + 1 − 1 = 0.367879; e − 1 − 1 = 0.718282;
        # C: e^−20 + 20 − 1 ≈ 19, clamped to 10.
        ("low_var_kl", [0.367879, 0.718282, 10.0]),
    ],
)
def test_estimators_by_hand(name: str, expected: list[float]) -> None:
    value = get_kl_estimator(name)(LOG_PROB, REF_LOG_PROB)
    torch.testing.assert_close(value, torch.tensor(expected, dtype=F64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("base", ["kl", "abs", "mse", "low_var_kl"])
def test_straight_through_variants(base: str) -> None:
    gen = torch.Generator().manual_seed(0)
    log_prob = torch.randn(4, 5, generator=gen, dtype=F64).requires_grad_(True)
    ref = log_prob.detach() + 0.5 * torch.randn(4, 5, generator=gen, dtype=F64)
    plus = get_kl_estimator(f"{base}+")(log_prob, ref)
    # Forward: the named estimator.
    torch.testing.assert_close(plus, get_kl_estimator(base)(log_prob, ref))
    # Backward: k2's gradient, d/dlogp ½(logp − ref)² = logp − ref.
    (grad,) = torch.autograd.grad(plus.sum(), log_prob)
    torch.testing.assert_close(grad, log_prob.detach() - ref)


def test_k3_gradient_differs_from_k2() -> None:
    # Guard that the straight-through test is not trivial for k3: ∂k3/∂logp = 1 − e^{log r}, at A
    # 1 − e^−1 = 0.632121, whereas k2's gradient there is d = 1.
    log_prob = LOG_PROB[:1].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(get_kl_estimator("low_var_kl")(log_prob, REF_LOG_PROB[:1]).sum(), log_prob)
    assert grad.item() == pytest.approx(1 - math.exp(-1))


def test_every_estimator_name_is_callable() -> None:
    for name in KL_ESTIMATORS:
        assert get_kl_estimator(name)(LOG_PROB, REF_LOG_PROB).shape == (3,)


def test_apply_kl_penalty_hand_example() -> None:
    # β = 0.5, k1 with d = old − ref:
    #   row 0: d = 0.1 0.2 0.3, scores 0 0 1 -> −0.05 −0.1 0.85; token-mean KL 0.2
    #   row 1: mask 1 1 0, d = 0.4 −0.2 (5 masked), scores 0 2 0 -> −0.2 2.1 0; token-mean KL 0.1
    #   mean over sequences: 0.15
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    ref = torch.zeros(2, 3, dtype=F64)
    old = torch.tensor([[0.1, 0.2, 0.3], [0.4, -0.2, 5.0]], dtype=F64)
    out = apply_kl_penalty(
        token_level_scores=scores,
        old_log_prob=old,
        ref_log_prob=ref,
        response_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
        kl_coef=0.5,
        kl_penalty="kl",
    )
    torch.testing.assert_close(
        out.token_level_rewards, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 2.1, 0.0]], dtype=F64)
    )
    torch.testing.assert_close(out.kl, torch.tensor([[0.1, 0.2, 0.3], [0.4, -0.2, 0.0]], dtype=F64))
    assert out.stats.kl.item() == pytest.approx(0.15)
    assert out.stats.kl_coef == 0.5


def test_adaptive_controller_updates() -> None:
    ctrl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000)
    # KL 12: e = clip(12/6 − 1, ±0.2) = 0.2 -> β = 0.1·(1 + 0.2·1000/10000) = 0.102
    ctrl.update(current_kl=12.0, n_steps=1000)
    assert ctrl.value == pytest.approx(0.102)
    # KL 5.4: e = 0.9 − 1 = −0.1 -> β = 0.102·(1 − 0.1·0.1) = 0.10098
    ctrl.update(current_kl=5.4, n_steps=1000)
    assert ctrl.value == pytest.approx(0.10098)


def test_fixed_controller_ignores_updates() -> None:
    ctrl = make_kl_controller("fixed", kl_coef=0.05)
    ctrl.update(current_kl=100.0, n_steps=256)
    assert ctrl.value == 0.05


def test_controller_state_dict_round_trip() -> None:
    ctrl = AdaptiveKLController(kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=12.0, n_steps=1000)
    restored = AdaptiveKLController(kl_coef=0.5, target_kl=6.0, horizon=10000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == pytest.approx(0.102)
    ctrl.update(current_kl=1.0, n_steps=500)
    restored.update(current_kl=1.0, n_steps=500)
    assert restored.value == ctrl.value
    fixed = FixedKLController(kl_coef=0.3)
    other = FixedKLController(kl_coef=0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.3


def test_adaptive_controller_needs_target_and_horizon() -> None:
    assert set(KL_CONTROLLERS) == {"fixed", "adaptive"}
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        make_kl_controller("adaptive", kl_coef=0.1)


def test_kl_loss_hand_example() -> None:
    # low_var_kl on tokens A and B (C masked): token-mean (0.367879 + 0.718282) / 2 = 0.543081;
    # loss = 0.1 · 0.543081 = 0.0543081.
    log_prob = LOG_PROB[None, :].clone().requires_grad_(True)
    out = compute_kl_loss(
        log_prob=log_prob,
        ref_log_prob=REF_LOG_PROB[None, :],
        response_mask=torch.tensor([[1, 1, 0]]),
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        loss_agg_mode="token-mean",
    )
    assert out.kl_loss.item() == pytest.approx(0.543081, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.0543081, abs=1e-7)
    # ∂/∂logp: 0.1 · (1 − e^{log r}) / 2: A 0.1·(1 − e^−1)/2 = 0.031606, B 0.1·(1 − e)/2 = −0.085914
    out.loss.backward()
    torch.testing.assert_close(
        log_prob.grad, torch.tensor([[0.031606, -0.085914, 0.0]], dtype=F64), atol=1e-6, rtol=0
    )
