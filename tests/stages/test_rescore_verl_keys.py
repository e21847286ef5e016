"""Which settings a rescore may change is judged on the keys the overrides set once verl's names are
translated (stages.floor.rescore.check_rescore_overrides)."""

from __future__ import annotations

import pytest

from stages.floor.rescore import check_rescore_overrides, rescore_settings
from verl_core.config import VerlFlowConfig
from verl_core.errors import ConfigError

CFG = VerlFlowConfig.model_validate({"tracking": {"enabled": False}})  # reward: the rule scorer


def test_verls_custom_reward_function_sets_the_reward_function() -> None:
    verl = ["custom_reward_function.path=/x/my_reward.py", "custom_reward_function.name=score_it"]
    lines = check_rescore_overrides(verl)
    assert lines == [
        "verl key custom_reward_function.path → reward.function=/x/my_reward.py:score_it, "
        "reward.scorers=[function] (FILE:NAME in reward.function, the only scorer)",
        "verl key custom_reward_function.name → nothing to set (read with custom_reward_function.path)",
    ]
    new = rescore_settings(CFG, verl)
    assert new.reward.function == "/x/my_reward.py:score_it"
    assert [s.name for s in new.reward.scorers] == ["function"]


def test_verls_reward_model_section_maps_into_the_reward() -> None:
    # DAPO's overlong buffer, in verl's reward_model section: reward.overlong_buffer_len here
    verl = ["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=16"]
    assert len(check_rescore_overrides(verl)) == 2
    assert rescore_settings(CFG, verl).reward.overlong_buffer_len == 16


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor_rollout_ref.actor.optim.lr=1e-5", "actor.lr"),  # verl's name of a key outside reward
        ("actor.lr=1e-5", "actor.lr"),
        ("trainer.total_training_steps=3", "trainer.total_iterations"),
        ("nosuch.key=1", "nosuch.key"),
    ],
)
def test_keys_outside_reward_and_sandbox_are_refused_after_translation(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^'{key}': a rescore changes only reward\.\* and sandbox\.\*"):
        check_rescore_overrides([override])


def test_a_dropped_verl_reward_key_says_why() -> None:
    # verl's reward-model micro-batch count: no key here (the reward model packs by token budget)
    with pytest.raises(ConfigError, match=r"^reward_model.micro_batch_size_per_gpu dropped: "):
        rescore_settings(CFG, ["reward_model.micro_batch_size_per_gpu=4"])
