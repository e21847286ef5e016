"""Stages stand side by side (STYLE.md §13): an AST scan of every import in stages/, the floor,
benchmarks/ and flows/ (relative imports resolved against the file's package). A stage file imports
verl_core and the floor, never another stage; the floor never imports a stage; benchmarks and flows
import no private name from stages; what a flow imports from a stage module is a Prefect task or flow
(helpers and readers live in the floor)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import prefect
import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGE_FILES = sorted((ROOT / "stages").glob("*.py"))
FLOOR_FILES = sorted((ROOT / "stages" / "floor").glob("*.py"))
BENCHMARK_FILES = sorted((ROOT / "benchmarks").glob("*.py"))
FLOW_FILES = sorted((ROOT / "flows").rglob("*.py"))  # the CLI package too


def _package(path: Path) -> list[str]:
    """The package a file's relative imports start from: ``flows/rl.py`` → ``["flows"]``; a
    package's ``__init__.py`` is in the package itself (``stages/floor/__init__.py`` → ``["stages",
    "floor"]``)."""
    return list(path.relative_to(ROOT).with_suffix("").parts[:-1])


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module of ``from ... import``: ``from .x import y`` in ``flows/rl.py`` is
    ``flows.x``, ``from ..stages.eval import y`` is ``stages.eval``, ``from . import y`` is ``flows``."""
    if node.level == 0:
        assert node.module is not None
        return node.module
    package = _package(path)
    if node.level - 1 > len(package):
        raise AssertionError(f"{_where(path, node.lineno)}: relative import beyond the top-level package")
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path, source: str | None = None) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import in ``path`` (function-level ones included; ``source``:
    its text, read from ``path`` by default); ``import a.b`` gives ``("a.b", [])``, ``from a import
    b, c`` gives ``("a", ["b", "c"])``; relative modules are made absolute."""
    found = []
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, _absolute(path, node), [alias.name for alias in node.names]))
    return found


def _stage_modules(module: str, names: list[str]) -> list[str]:
    """The modules of ``stages`` an import reaches: ``from stages import eval`` reaches ``stages.eval``."""
    if module == "stages":
        return [f"stages.{n}" for n in names] or ["stages"]
    return [module] if module.startswith("stages.") else []


def _is_floor(module: str) -> bool:
    return module == "stages.floor" or module.startswith("stages.floor.")


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_scan_sees_the_stage_files() -> None:
    names = {p.stem for p in STAGE_FILES}
    assert {"rollout", "reward", "ppo_update", "validate", "eval", "export"} <= names
    assert {p.stem for p in FLOOR_FILES} == {
        "__init__",
        "locations",
        "policy",  # issue 42: builders.py split by job
        "scorers",
        "engines",
        "rollouts",
        "specs",
        "artifacts",
        "reports",
        "samples",
        "session",  # issue 42: state.py split by job, the RL session explicit
        "opening",
        "checkpoint",
        "lineage",
        "logging",
        "environment",
        "rescore",
        "retry",
        "parent",
        "commit",  # issue 42: was spmd.py (the SPMD skip-and-commit pattern)
        "heldout",
        "registry",  # issue 40: the model registry (aliases, decisions), the gate's champion, model cards
        "champion",
        "model_card",
        "initial_model",  # issue 40: a champion's export in the store fetched to this machine
        "fingerprint",  # issue 42: a run's artifacts by digest, per-process values left out
    }


def test_scan_resolves_relative_imports() -> None:
    source = "from .pipeline import a\nfrom ..stages.eval import b\nfrom . import rl\nimport stages.x\n"
    assert _imports(ROOT / "flows" / "x.py", source) == [
        (1, "flows.pipeline", ["a"]),
        (2, "stages.eval", ["b"]),
        (3, "flows", ["rl"]),
        (4, "stages.x", []),
    ]
    # in a stage file, a sibling stage is reached relatively too
    found = _imports(ROOT / "stages" / "eval.py", "from .floor.artifacts import y\nfrom . import rollout\n")
    assert [m for _, module, names in found for m in _stage_modules(module, names)] == [
        "stages.floor.artifacts",
        "stages.rollout",
    ]
    assert _imports(ROOT / "stages" / "floor" / "__init__.py", "from .. import eval\n") == [
        (1, "stages", ["eval"])
    ]


@pytest.mark.parametrize("path", STAGE_FILES + FLOOR_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_stages_and_the_floor_import_only_the_floor(path: Path) -> None:
    # a stage file imports verl_core and stages.floor only; the floor imports verl_core and itself
    bad = [
        f"{_where(path, line)}: imports {reached}"
        for line, module, names in _imports(path)
        for reached in _stage_modules(module, names)
        if not _is_floor(reached)
    ]
    assert not bad, "stages import only stages.floor (and verl_core):\n" + "\n".join(bad)


def _private_stage_imports(path: Path) -> list[str]:
    """``from stages.x import _y``, and ``from stages import x as m`` followed by ``m._y``."""
    tree = ast.parse(path.read_text(), str(path))
    bad, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(path, node)
            if module == "stages" or module.startswith("stages."):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        bad.append(f"{_where(path, node.lineno)}: from {module} import {alias.name}")
                    elif module == "stages":  # a stage module under a local name
                        aliases[alias.asname or alias.name] = f"stages.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("stages.") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
        ):
            bad.append(f"{_where(path, node.lineno)}: {aliases[node.value.id]}.{node.attr}")
    return bad


@pytest.mark.parametrize("path", BENCHMARK_FILES, ids=lambda p: p.name)
def test_benchmarks_import_no_private_stage_name(path: Path) -> None:
    bad = _private_stage_imports(path)
    assert not bad, "benchmarks call components, never a stage's private helpers:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", FLOW_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_flows_import_no_private_stage_name(path: Path) -> None:
    bad = _private_stage_imports(path)
    assert not bad, "flows use stage tasks and the floor's public names:\n" + "\n".join(bad)


def _not_tasks(module: str, names: list[str]) -> list[str]:
    """What ``from {module} import {names}`` takes from a stage module that is not a Prefect task or
    flow (``from stages import x`` takes the module ``stages.x`` itself)."""
    if module == "stages":
        return [f"stages.{n} (a module)" for n in names]
    if not names:
        return [f"{module} (a module)"]
    stage = importlib.import_module(module)
    return [
        f"{module}.{name}"
        for name in names
        if not isinstance(getattr(stage, name, None), (prefect.Task, prefect.Flow))
    ]


def test_the_task_check_catches_helpers() -> None:
    assert _not_tasks("stages.report", ["report", "PLOTS"]) == ["stages.report.PLOTS"]
    assert _not_tasks("stages.eval", ["evaluate"]) == []
    assert _not_tasks("stages", ["eval"]) == ["stages.eval (a module)"]
    assert _not_tasks("stages.eval", []) == ["stages.eval (a module)"]


@pytest.mark.parametrize("path", FLOW_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_flows_take_only_tasks_and_flows_from_stage_modules(path: Path) -> None:
    bad = [
        f"{_where(path, line)}: {what}"
        for line, module, names in _imports(path)
        if (module == "stages" or module.startswith("stages.")) and not _is_floor(module)
        for what in _not_tasks(module, [n for n in names if not _is_floor(f"{module}.{n}")])
    ]
    assert not bad, (
        "a flow takes Prefect tasks/flows from stage modules; readers and helpers come from stages.floor:\n"
        + "\n".join(bad)
    )
