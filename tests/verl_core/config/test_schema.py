"""The config schema: defaults and descriptions, cross-field checks, the algorithm names it shares
with the registries, and the shipped configs (headers, experiment names, every field read)."""

from __future__ import annotations

import ast
import itertools
import re
import typing
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from verl_core import algorithms
from verl_core.config import (
    ActorConfig,
    AdvEstimator,
    KLEstimator,
    LossAggMode,
    PolicyLoss,
    VerlFlowConfig,
    load_config,
)
from verl_core.config.schema import (
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    KLControlConfig,
    RefConfig,
    RolloutConfig,
)
from verl_core.data import adapter_names
from verl_core.errors import ConfigError
from verl_core.rollout import ENGINES

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))

# Fields no code reads yet, each waiting for the open issue that wires it.
NOT_YET_READ: dict[str, str] = {}


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


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        sub = _section(field.annotation)
        out.extend(_leaves(sub, f"{prefix}{name}.") if sub is not None else [prefix + name])
    return out


# --------------------------------------------------------------------------------------------------
# Defaults and descriptions


def test_every_field_has_a_default_and_a_description() -> None:
    VerlFlowConfig()  # all defaults validate
    missing = [path for path, desc in _fields(VerlFlowConfig) if not desc]
    assert missing == []


def test_sections_named_as_verl_users_know_them() -> None:
    assert list(VerlFlowConfig.model_fields) == [
        "data", "model", "sft", "actor", "critic", "ref", "rollout", "reward",
        "algorithm", "trainer", "store", "tracking", "export", "eval", "execution", "sandbox", "parent",
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


# --------------------------------------------------------------------------------------------------
# Every field is read somewhere


def _owners(model: type[BaseModel], prefix: str = "") -> dict[str, tuple[str, str, str]]:
    """leaf path → (class that holds it, the attribute name of that section, the field name)."""
    out: dict[str, tuple[str, str, str]] = {}
    for name, field in model.model_fields.items():
        sub = _section(field.annotation)
        if sub is not None:
            out.update(_owners(sub, f"{prefix}{name}."))
        else:
            out[prefix + name] = (model.__name__, prefix.rstrip(".").rsplit(".", 1)[-1], name)
    return out


class _Reads(ast.NodeVisitor):
    """Qualified reads of one file: ``(tag, field)`` for every ``<x>.field`` where ``<x>`` is
    ``<...>.section`` (tag ``.section``) or a name bound to a section: annotated with its class
    (tag: the class name), assigned from ``<...>.section`` or looped over it, or ``self`` in the class;
    ``getattr(<...>.section, name)`` reads every field named by a string literal of the file.
    Validators (``@model_validator`` / ``@field_validator``) do not count: checking is not using."""

    def __init__(self, classes: set[str]) -> None:
        self.classes, self.bound, self.reads = classes, defaultdict(set), set()
        self.pending: list[tuple[str, str]] = []  # (name, field), resolved once every binding is known
        self.dynamic: set[str] = set()  # sections read as getattr(<...>.section, name)
        self.strings: set[str] = set()  # string literals, the names such getattr calls may use

    def _tags(self, node: ast.expr | None) -> set[str]:
        if node is None:
            return set()
        if isinstance(node, ast.Attribute):
            return {"." + node.attr}
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        return names & self.classes  # an annotation naming a section class

    def _bind(self, target: ast.expr, value: ast.expr | None) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts, strict=False):
                self._bind(t, v)
        elif isinstance(target, ast.Name) and isinstance(value, ast.Attribute):
            self.bound[target.id].add("." + value.attr)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if node.name in self.classes:
            self.bound["self"].add(node.name)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if any("validator" in ast.unparse(d) for d in node.decorator_list):
            return
        for arg in [*node.args.args, *node.args.kwonlyargs]:
            self.bound[arg.arg] |= self._tags(arg.annotation) & self.classes
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if isinstance(node.target, ast.Name):
            self.bound[node.target.id] |= self._tags(node.annotation) & self.classes
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._bind(target, node.value)
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        self._bind(node.target, node.iter)
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._bind(node.target, node.iter)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Attribute):
            self.reads.add(("." + node.value.attr, node.attr))
        elif isinstance(node.value, ast.Name):
            self.pending.append((node.value.id, node.attr))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func, args = node.func, node.args
        if (
            isinstance(func, ast.Name)
            and func.id == "getattr"
            and args
            and isinstance(args[0], ast.Attribute)
        ):
            self.dynamic.add("." + args[0].attr)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            self.strings.add(node.value)

    def resolved(self) -> set[tuple[str, str]]:
        bound = {(tag, f) for name, f in self.pending for tag in self.bound.get(name, ())}
        return self.reads | bound | {(tag, s) for tag in self.dynamic for s in self.strings}


def _qualified_reads(classes: set[str]) -> set[tuple[str, str]]:
    reads: set[tuple[str, str]] = set()
    for folder in ("verl_core", "stages", "flows"):
        for path in sorted((REPO / folder).rglob("*.py")):
            visitor = _Reads(classes)
            visitor.visit(ast.parse(path.read_text()))
            reads |= visitor.resolved()
    return reads


def test_every_config_field_is_read_somewhere() -> None:
    owners = _owners(VerlFlowConfig)
    assert set(NOT_YET_READ) <= set(owners), "an allow-listed field is gone: drop it from NOT_YET_READ"
    reads = _qualified_reads({cls for cls, _, _ in owners.values()})

    def is_read(leaf: str) -> bool:
        cls, section, name = owners[leaf]
        return ("." + section, name) in reads or (cls, name) in reads

    unread = [leaf for leaf in owners if not is_read(leaf) and leaf not in NOT_YET_READ]
    assert unread == [], f"fields no code reads (wire them, or remove them from the schema): {unread}"
    # an allow-listed field that code now reads must leave the list
    wired = [leaf for leaf in NOT_YET_READ if is_read(leaf)]
    assert wired == [], f"read now, drop from NOT_YET_READ: {wired}"


def test_ref_path_without_a_kl_term_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"ref.path: 'org/ref' is set but nothing uses a reference"):
        load_config(None, ["ref.path=org/ref"])
    assert load_config(None, ["ref.path=org/ref", "actor.use_kl_loss=true"]).ref.path == "org/ref"
