"""verl_core.registry: the one name -> variant registry behind algorithms, rule scorers, rollout
engines and dataset adapters, with one error format listing the valid names."""

from __future__ import annotations

import pytest

from verl_core import algorithms
from verl_core.data import adapter_names, get_adapter, register_adapter
from verl_core.data.adapters import ADAPTERS
from verl_core.errors import ConfigError, DataError
from verl_core.registry import Registry, UnknownNameError
from verl_core.reward.rules import RULE_SCORERS, get_rule_scorer
from verl_core.rollout import ENGINES, make_engine, register_engine


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
    "registry",
    [
        algorithms.ADV_ESTIMATOR_REGISTRY,
        algorithms.POLICY_LOSS_REGISTRY,
        algorithms.KL_ESTIMATOR_REGISTRY,
        algorithms.KL_CONTROLLER_REGISTRY,
        algorithms.LOSS_AGG_REGISTRY,
        RULE_SCORERS,
        ENGINES,
        ADAPTERS,
    ],
    ids=lambda r: r.kind,
)
def test_every_family_is_one_registry_class(registry: object) -> None:
    assert type(registry) is Registry


def test_rule_scorer_lookup_error_lists_data_sources() -> None:
    with pytest.raises(UnknownNameError, match=r"^Unknown data_source for the rule scorer 'openai/gsm9k'\. "):
        get_rule_scorer("openai/gsm9k")


def test_unknown_engine_is_a_config_error_in_the_registry_format() -> None:
    assert ENGINES.names() == ("auto", "hf", "vllm")
    with pytest.raises(ConfigError) as err:
        make_engine("vlm", "some/model")
    assert str(err.value) == (
        "rollout.name: Unknown rollout engine 'vlm'. Valid names: auto, hf, vllm. Did you mean 'vllm'?"
    )


def test_unknown_adapter_is_a_data_error_in_the_registry_format() -> None:
    assert adapter_names() == ["arithmetic", "gsm8k", "hf", "jsonl", "parquet"]
    with pytest.raises(DataError) as err:
        get_adapter("jsonll")
    assert str(err.value) == (
        "data.source: Unknown dataset adapter 'jsonll'. Valid names: arithmetic, gsm8k, hf, jsonl, "
        "parquet. Did you mean 'jsonl'?"
    )


def test_names_cannot_be_registered_twice() -> None:
    with pytest.raises(ValueError, match="rollout engine 'hf' is already registered"):
        register_engine("hf")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="dataset adapter 'jsonl' is already registered"):
        register_adapter(get_adapter("jsonl"))
