"""Stages stand side by side (STYLE.md §13): an AST scan of every import in stages/, the floor,
benchmarks/ and flows/. A stage file imports verl_core and the floor, never another stage; the floor
never imports a stage; benchmarks and flows import no private name from stages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGE_FILES = sorted((ROOT / "stages").glob("*.py"))
FLOOR_FILES = sorted((ROOT / "stages" / "floor").glob("*.py"))
BENCHMARK_FILES = sorted((ROOT / "benchmarks").glob("*.py"))


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import in ``path`` (function-level ones included);
    ``import a.b`` gives ``("a.b", [])``, ``from a import b, c`` gives ``("a", ["b", "c"])``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
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
        "builders",
        "artifacts",
        "state",
        "logging",
    }


@pytest.mark.parametrize("path", STAGE_FILES, ids=lambda p: p.name)
def test_a_stage_imports_no_other_stage(path: Path) -> None:
    bad = [
        f"{_where(path, line)}: imports {reached}"
        for line, module, names in _imports(path)
        for reached in _stage_modules(module, names)
        if not _is_floor(reached)
    ]
    assert not bad, "a stage file imports verl_core and stages.floor only:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", FLOOR_FILES, ids=lambda p: p.name)
def test_the_floor_imports_no_stage(path: Path) -> None:
    bad = [
        f"{_where(path, line)}: imports {reached}"
        for line, module, names in _imports(path)
        for reached in _stage_modules(module, names)
        if not _is_floor(reached)
    ]
    assert not bad, "the floor imports verl_core and itself only:\n" + "\n".join(bad)


def _private_stage_imports(path: Path) -> list[str]:
    """``from stages.x import _y``, and ``from stages import x as m`` followed by ``m._y``."""
    tree = ast.parse(path.read_text(), str(path))
    bad, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "stages" or node.module.startswith("stages."):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        bad.append(f"{_where(path, node.lineno)}: from {node.module} import {alias.name}")
                    elif node.module == "stages":  # a stage module under a local name
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


@pytest.mark.parametrize("path", sorted((ROOT / "flows").glob("*.py")), ids=lambda p: p.name)
def test_flows_import_no_private_stage_name(path: Path) -> None:
    bad = _private_stage_imports(path)
    assert not bad, "flows use stage tasks and the floor's public names:\n" + "\n".join(bad)
