"""Registry behaviour and the exact name lists the config schema relies on."""

from collections.abc import Callable
from typing import get_args

import pytest
import torch

from verl_core.algorithms import (
    ADV_ESTIMATORS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AdvEstimatorName,
    KLControllerName,
    KLEstimatorName,
    LossAggMode,
    PolicyLossName,
    Registry,
    UnknownNameError,
    aggregate_loss,
    get_adv_estimator,
    get_kl_controller,
    get_kl_estimator,
    get_policy_loss,
)


def _double(x: int) -> int:
    return 2 * x


def test_register_and_get() -> None:
    registry: Registry[object] = Registry("thing")
    registry.register("double")(_double)
    assert registry.get("double") is _double
    assert "double" in registry
    assert registry.names() == ("double",)


def test_duplicate_name_is_rejected() -> None:
    registry: Registry[object] = Registry("thing")
    registry.register("double")(_double)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("double")(_double)


def test_unknown_name_lists_sorted_names_and_suggests() -> None:
    registry: Registry[object] = Registry("thing")
    for name in ("zeta", "alpha", "gamma"):
        registry.register(name)(_double)
    with pytest.raises(UnknownNameError) as err:
        registry.get("gama")
    # Plain message (not KeyError's quoted repr), names sorted, closest suggested.
    assert str(err.value) == "Unknown thing 'gama'. Valid names: alpha, gamma, zeta. Did you mean 'gamma'?"
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)


def test_unknown_name_without_close_match_has_no_suggestion() -> None:
    registry: Registry[object] = Registry("thing")
    registry.register("alpha")(_double)
    with pytest.raises(UnknownNameError, match=r"^Unknown thing 'zzzzzz'. Valid names: alpha.$"):
        registry.get("zzzzzz")


@pytest.mark.parametrize(
    ("getter", "bad", "suggestion"),
    [
        (get_adv_estimator, "grop", "grpo"),
        (get_policy_loss, "vanila", "vanilla"),
        (get_kl_estimator, "low_var", "low_var_kl"),
        (get_kl_controller, "adaptiv", "adaptive"),
    ],
)
def test_public_getters_list_valid_names(getter: Callable[[str], object], bad: str, suggestion: str) -> None:
    with pytest.raises(ValueError) as err:
        getter(bad)
    assert f"Did you mean {suggestion!r}" in str(err.value)


def test_unknown_loss_agg_mode_lists_modes() -> None:
    with pytest.raises(KeyError) as err:
        aggregate_loss(torch.ones(1, 2), torch.ones(1, 2), "token-sum")
    assert (
        "Valid names: seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-mean."
        in str(err.value)
    )


def test_exported_name_tuples_are_exactly_the_verl_names() -> None:
    assert set(ADV_ESTIMATORS) == {
        "gae",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
    }
    assert set(POLICY_LOSSES) == {"vanilla", "gspo"}
    assert set(KL_ESTIMATORS) == {"kl", "abs", "mse", "low_var_kl", "kl+", "abs+", "mse+", "low_var_kl+"}
    assert set(LOSS_AGG_MODES) == {
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    }
    assert set(KL_CONTROLLERS) == {"fixed", "adaptive"}


@pytest.mark.parametrize(
    ("literal", "names"),
    [
        (AdvEstimatorName, ADV_ESTIMATORS),
        (PolicyLossName, POLICY_LOSSES),
        (KLEstimatorName, KL_ESTIMATORS),
        (LossAggMode, LOSS_AGG_MODES),
        (KLControllerName, KL_CONTROLLERS),
    ],
)
def test_literal_types_match_registries(literal: object, names: tuple[str, ...]) -> None:
    assert sorted(get_args(literal)) == list(names)
