"""The config schema: defaults and descriptions, cross-field checks, the algorithm names it shares
with the registries, and the shipped configs (headers, experiment names). Every key read and
tested: test_keys_used.py."""

from __future__ import annotations

import itertools
import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from verl_core import algorithms
from verl_core.config import (
    ActorConfig,
    AdvEstimator,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    KLControlConfig,
    KLEstimator,
    LossAggMode,
    PolicyLoss,
    RefConfig,
    RolloutConfig,
    VerlFlowConfig,
    load_config,
)
from verl_core.data import adapter_names
from verl_core.errors import ConfigError
from verl_core.rollout import ENGINES

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


def _fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str | None]]:
    """(dotted path, description) of every field, sections and their leaves."""
    out = []
    for name, field in model.model_fields.items():
        out.append((prefix + name, field.description))
        sub = _section(field.annotation)
        if sub is not None:
            out.extend(_fields(sub, f"{prefix}{name}."))
    return out


def _section(annotation: object) -> type[BaseModel] | None:
    for cand in (annotation, *typing.get_args(annotation)):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
    return None


# --------------------------------------------------------------------------------------------------
# Defaults and descriptions


def test_every_field_has_a_default_and_a_description() -> None:
    VerlFlowConfig()  # all defaults validate
    missing = [path for path, desc in _fields(VerlFlowConfig) if not desc]
    assert missing == []


def test_sections_named_as_verl_users_know_them() -> None:
    # retrain and gate are verl-flow's own (issue 40): verl has no counterpart
    assert list(VerlFlowConfig.model_fields) == [
        "data", "model", "sft", "actor", "critic", "ref", "rollout", "reward",
        "algorithm", "trainer", "store", "tracking", "export", "retrain", "eval", "gate", "execution",
        "sandbox", "parent",
    ]  # fmt: skip


def test_ref_path_says_what_none_means() -> None:
    desc = RefConfig.model_fields["path"].description or ""
    assert desc.startswith("A reference policy other than the starting policy (HF id or local dir)")
    assert "None: the SFT/start policy" in desc


# --------------------------------------------------------------------------------------------------
# Algorithm names: one list, in verl_core.algorithms


def test_algorithm_literals_are_the_registries_literals() -> None:
    assert AdvEstimator is algorithms.AdvEstimatorName
    assert PolicyLoss is algorithms.PolicyLossName
    assert KLEstimator is algorithms.KLEstimatorName
    assert LossAggMode is algorithms.LossAggMode
    assert AlgorithmConfig.model_fields["adv_estimator"].annotation is algorithms.AdvEstimatorName
    assert AlgorithmConfig.model_fields["kl_penalty"].annotation is algorithms.KLEstimatorName
    assert KLControlConfig.model_fields["type"].annotation is algorithms.KLControllerName
    assert ActorConfig.model_fields["policy_loss"].annotation is algorithms.PolicyLossName
    assert ActorConfig.model_fields["kl_loss_type"].annotation is algorithms.KLEstimatorName
    assert CriticConfig.model_fields["loss_agg_mode"].annotation is algorithms.LossAggMode
    actor_agg = ActorConfig.model_fields["loss_agg_mode"].annotation
    assert set(typing.get_args(actor_agg)) == {algorithms.LossAggMode, type(None)}


@pytest.mark.parametrize(
    ("literal", "registered"),
    [
        (AdvEstimator, algorithms.ADV_ESTIMATOR_REGISTRY.names()),
        (PolicyLoss, algorithms.POLICY_LOSS_REGISTRY.names()),
        (KLEstimator, algorithms.KL_ESTIMATOR_REGISTRY.names()),
        (LossAggMode, algorithms.LOSS_AGG_REGISTRY.names()),
        (algorithms.KLControllerName, algorithms.KL_CONTROLLER_REGISTRY.names()),
        (DataConfig.model_fields["source"].annotation, tuple(adapter_names())),
        (RolloutConfig.model_fields["name"].annotation, ENGINES.names()),
    ],
)
def test_config_names_are_exactly_the_registered_names(literal: object, registered: tuple[str, ...]) -> None:
    assert sorted(typing.get_args(literal)) == list(registered)


# --------------------------------------------------------------------------------------------------
# Cross-field checks


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.adv_estimator=gae", "critic.enable=false"],
            "critic.enable: got false, expected true or unset when algorithm.adv_estimator is 'gae'",
        ),
        (
            ["data.train_batch_size=8", "actor.ppo_mini_batch_size=3"],
            "actor.ppo_mini_batch_size: 3 must divide data.train_batch_size (8)",
        ),
        (
            ["algorithm.adv_estimator=gae", "data.train_batch_size=8", "critic.ppo_mini_batch_size=3"],
            "critic.ppo_mini_batch_size: 3 must divide data.train_batch_size (8)",
        ),
        (
            ["algorithm.adv_estimator=grpo", "critic.enable=true", "critic.ppo_mini_batch_size=3"],
            "critic.ppo_mini_batch_size: 3 must divide data.train_batch_size (8)",
        ),
    ],
)
def test_cross_field_errors_name_both_fields(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_critic_mini_batch_is_free_without_a_critic() -> None:
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "critic.ppo_mini_batch_size=3"])
    assert not cfg.use_critic


def test_use_critic_follows_the_estimator_unless_set() -> None:
    assert load_config(None, ["algorithm.adv_estimator=gae"]).use_critic
    assert not load_config(None, ["algorithm.adv_estimator=grpo"]).use_critic
    assert load_config(None, ["algorithm.adv_estimator=grpo", "critic.enable=true"]).use_critic


def test_deployments_mode_refuses_stores_other_workers_cannot_see() -> None:
    deploy = ["execution.mode=deployments", "tracking.uri=http://mlflow.internal:5000"]
    with pytest.raises(
        ConfigError, match=r"^store.url: '/tmp/runs' is local to this machine; .*shared_filesystem"
    ):
        load_config(None, [*deploy, "store.url=/tmp/runs"])
    with pytest.raises(ConfigError, match=r"^store.url: 'memory://x' lives inside one process"):
        load_config(None, [*deploy, "store.url=memory://x"])
    with pytest.raises(ConfigError, match=r"^tracking.uri: not set \(the default is a sqlite file"):
        load_config(None, ["execution.mode=deployments", "store.url=s3://b/p"])
    assert load_config(None, [*deploy, "store.url=s3://b/p"]).execution.mode == "deployments"
    shared = load_config(
        None, ["execution.mode=deployments", "execution.shared_filesystem=true", "store.url=/mnt/nfs/runs"]
    )
    assert shared.store.url == "/mnt/nfs/runs" and shared.tracking.uri is None


# --------------------------------------------------------------------------------------------------
# actor.loss_agg_mode: None until chosen


@pytest.mark.parametrize(
    ("policy_loss", "given", "resolved"),
    [
        ("vanilla", None, "token-mean"),  # the default, as before
        ("gspo", None, "seq-mean-token-mean"),  # verl forces per-sequence means for GSPO
        ("gspo", "token-mean", "token-mean"),  # an explicit choice wins
        ("vanilla", "seq-mean-token-sum-norm", "seq-mean-token-sum-norm"),
    ],
)
def test_loss_agg_mode_resolves_default_by_policy_loss(
    policy_loss: str, given: str | None, resolved: str
) -> None:
    overrides = [f"actor.policy_loss={policy_loss}"]
    if given is not None:
        overrides.append(f"actor.loss_agg_mode={given}")
    actor = load_config(None, overrides).actor
    assert actor.loss_agg_mode == given
    assert actor.resolved_loss_agg_mode == resolved


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_keep_their_loss_agg_modes(path: Path) -> None:
    # before loss_agg_mode could be None both defaulted to token-mean; no shipped config sets either
    cfg = load_config(path)
    assert cfg.actor.resolved_loss_agg_mode == "token-mean"
    assert cfg.critic.loss_agg_mode == "token-mean"


# --------------------------------------------------------------------------------------------------
# Shipped configs


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_validates_and_has_a_header(path: Path) -> None:
    load_config(path)
    lines = path.read_text().splitlines()
    header = "\n".join(itertools.takewhile(lambda line: line.startswith("#"), lines))
    assert len(header.splitlines()) >= 3, f"{path.name}: no header comment saying what it is for"
    assert re.search(r"(?i)tested on|hardware:", header), f"{path.name}: header names no hardware"
    assert f"verl-flow run configs/{path.name}" in header, f"{path.name}: header has no run command"


def test_shipped_configs_have_distinct_experiment_names() -> None:
    names = [(yaml.safe_load(p.read_text()).get("trainer") or {}).get("experiment_name") for p in SHIPPED]
    assert None not in names, "every shipped config sets trainer.experiment_name"
    assert len(set(names)) == len(names), names


def test_ref_path_without_a_kl_term_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"ref.path: 'org/ref' is set but nothing uses a reference"):
        load_config(None, ["ref.path=org/ref"])
    assert load_config(None, ["ref.path=org/ref", "actor.use_kl_loss=true"]).ref.path == "org/ref"


@pytest.mark.parametrize(
    "override",
    ["data.pack_token_budget=512", "data.pack_algorithm=bfd"],  # removed: nothing read them
)
def test_removed_keys_are_unknown_keys(override: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^unknown key '{re.escape(key)}'; valid keys here: source, "):
        load_config(None, [override])


def test_generate_is_no_decode_path() -> None:
    # the transformers-generate reference is HFEngine.generate_reference, for tests, not a config value
    with pytest.raises(ConfigError, match=r"^rollout.decode: got 'generate', expected one of 'auto', 'loop'"):
        load_config(None, ["rollout.decode=generate"])
    assert load_config(None, ["rollout.decode=loop"]).rollout.decode == "loop"
