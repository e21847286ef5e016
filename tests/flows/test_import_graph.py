"""No import circle in flows/: an AST scan of every import of every module under flows/, at module
level and inside functions alike (a function-level import only hides a circle until the function
runs), and a search of the graph for a cycle. An SPMD job names what its ranks run by an import path
string (``"flows.gpu:rl_rank"``, resolved by :mod:`launcher.spmd` in the worker process), not an
import; those strings must resolve."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from launcher.spmd import resolve

ROOT = Path(__file__).resolve().parents[2]
FLOW_FILES = sorted((ROOT / "flows").rglob("*.py"))


def _module(path: Path) -> str:
    """``flows/cli/run.py`` → ``flows.cli.run``, ``flows/cli/__init__.py`` → ``flows.cli``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, modules: set[str], source: str | None = None) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere in its text: ``import a.b`` → ``a.b``;
    ``from a import b`` → ``a.b`` when that is a module, else ``a``; relative imports resolved
    against the file's package."""
    package = _module(path).split(".") if path.name == "__init__.py" else _module(path).split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source if source is not None else path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - (node.level - 1)] + ([base] if base else []))
            subs = {f"{base}.{alias.name}" for alias in node.names} & modules
            found |= subs or {base}
    return found & modules


def _graph(files: list[Path]) -> dict[str, set[str]]:
    modules = {_module(p) for p in files}
    return {_module(p): _imported(p, modules) - {_module(p)} for p in files}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, None when it has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_scan_sees_function_level_and_relative_imports() -> None:
    modules = {"flows.gpu", "flows.rl", "flows.cli", "flows.cli.run", "flows"}
    source = "from flows import rl\n\ndef f():\n    from .cli import run\n    import flows.gpu\n"
    assert _imported(ROOT / "flows" / "x.py", modules, source) == {"flows.rl", "flows.cli.run", "flows.gpu"}
    source = "from .run import x\nfrom . import run\n"
    assert _imported(ROOT / "flows" / "cli" / "__init__.py", modules, source) == {"flows.cli.run"}


def test_the_cycle_search_finds_a_circle_through_three_modules() -> None:
    # gpu → spmd → rl → gpu was the circle of issue 29 (spmd imported gpu and rl inside a function)
    graph = {"gpu": {"spmd"}, "spmd": {"rl"}, "rl": {"gpu", "sampling"}, "sampling": set()}
    assert _cycle(graph) == ["gpu", "spmd", "rl", "gpu"]
    assert _cycle({"gpu": {"rl"}, "rl": {"sampling"}, "sampling": set()}) is None


def test_flows_have_no_import_circle() -> None:
    graph = _graph(FLOW_FILES)
    assert {"flows.rl", "flows.gpu", "flows.cli", "flows.cli.run"} <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, "an import circle in flows/: " + " → ".join(cycle or [])


ENTRY = re.compile(r"""\b(?:entry|flow)="([\w.]+:\w+)\"""")


@pytest.mark.parametrize("path", [p for p in FLOW_FILES if ENTRY.search(p.read_text())], ids=lambda p: p.name)
def test_spmd_entry_points_named_by_flows_resolve(path: Path) -> None:
    for name in ENTRY.findall(path.read_text()):
        assert callable(resolve(name)), name
