"""One source for every default: the spec types of ``verl_core`` (frozen dataclasses and NamedTuples
named ``*Spec``, built by the stages from the config) have none of their own; the config schema holds
them. A default on a spec would be a second value for the same knob, and the two drift (``PPOSpec``'s
token budgets once defaulted to 16384 while the schema said 4096 and 8192)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3] / "verl_core"

# spec types that are not built from the config, and may keep defaults (type name → why); none today
NOT_CONFIG_MIRRORS: dict[str, str] = {}


def _is_record(node: ast.ClassDef) -> bool:
    """A dataclass (``@dataclass`` or ``@dataclass(...)``) or a ``NamedTuple`` subclass."""
    decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
    names = {d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "") for d in decorators}
    bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
    return "dataclass" in names or "NamedTuple" in bases


def defaults_of(node: ast.ClassDef) -> list[str]:
    """The fields of a record's body that have a default (``= value`` or ``= field(...)``)."""
    return [
        s.target.id
        for s in node.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None
    ]


def spec_defaults() -> dict[str, list[str]]:
    """``module:Type`` → its fields that have a default, for every ``*Spec`` record under verl_core."""
    out: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Spec") and _is_record(node):
                out[f"{path.relative_to(ROOT.parent)}:{node.name}"] = defaults_of(node)
    return out


def test_the_scan_finds_the_spec_types() -> None:
    found = {key.split(":")[1] for key in spec_defaults()}
    # the ones the stages build from the config, at least (a scan that finds nothing passes nothing)
    assert {"PPOSpec", "ActorLossSpec", "RolloutCorrectionSpec", "OptimSpec", "SFTLoopSpec"} <= found


@pytest.mark.parametrize("key", sorted(spec_defaults()))
def test_spec_types_have_no_defaults_of_their_own(key: str) -> None:
    if key.split(":")[1] in NOT_CONFIG_MIRRORS:
        return
    defaults = spec_defaults()[key]
    assert not defaults, (
        f"{key} gives {defaults} a default: spec fields are required, the schema "
        "(verl_core/config) holds the defaults and the stage passes them"
    )


def test_the_scan_sees_a_default() -> None:
    # a spec written with a default, as the scan reads it: the check can fail
    src = "@dataclass(frozen=True)\nclass XSpec:\n    a: int\n    b: int = 3\n    c: int | None = None\n"
    node = ast.parse(src).body[0]
    assert isinstance(node, ast.ClassDef) and _is_record(node)
    assert defaults_of(node) == ["b", "c"]
