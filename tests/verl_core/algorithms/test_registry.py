"""The algorithm registries: their getters' errors and the exact name lists the config schema relies on."""

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
    aggregate_loss,
    get_adv_estimator,
    get_kl_controller,
    get_kl_estimator,
    get_policy_loss,
)


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
