"""No import circle in verl_core/, stages/, flows/ or launcher/: an AST scan of every import of every
module under the four packages (one graph, so a circle across packages counts too), at module level
and inside functions alike (a function-level import only hides a circle until the function runs), and
a search of the graph for a cycle. Imports under ``if TYPE_CHECKING:`` are left out: they never run,
and a module that takes another's type for its annotations (``config.preflight`` checks a
``VerlFlowConfig``, which runs those checks) does not depend on it to import or run. An SPMD job
names what its ranks run by an import path string (``"flows.gpu:rl_rank"``, resolved by
:mod:`launcher.spmd` in the worker process), not an import; those strings must resolve."""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.spmd import resolve

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("verl_core", "stages", "flows", "launcher")
FILES = sorted(p for name in PACKAGES for p in (ROOT / name).rglob("*.py"))
FLOW_FILES = [p for p in FILES if p.relative_to(ROOT).parts[0] == "flows"]


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
    for node in _run_time_nodes(ast.parse(source if source is not None else path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - (node.level - 1)] + ([base] if base else []))
            subs = {f"{base}.{alias.name}" for alias in node.names} & modules
            found |= subs or {base}
    return found & modules


def _run_time_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` but the bodies of ``if TYPE_CHECKING:`` (``typing.TYPE_CHECKING``)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}:
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


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


def test_the_scan_leaves_out_type_checking_imports_only() -> None:
    modules = {"verl_core.config.schema", "verl_core.config.inert"}
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from verl_core.config.schema import X\n"
        "else:\n    from verl_core.config import inert\n"
    )
    assert _imported(ROOT / "verl_core" / "config" / "preflight.py", modules, source) == {
        "verl_core.config.inert"
    }
    source = (
        "def f():\n    from verl_core.config.schema import VerlFlowConfig\n"  # a function's import counts
    )
    assert _imported(ROOT / "verl_core" / "config" / "inert.py", modules, source) == {
        "verl_core.config.schema"
    }


def test_the_cycle_search_finds_a_circle_through_three_modules() -> None:
    # gpu → spmd → rl → gpu was the circle of issue 29 (spmd imported gpu and rl inside a function)
    graph = {"gpu": {"spmd"}, "spmd": {"rl"}, "rl": {"gpu", "sampling"}, "sampling": set()}
    assert _cycle(graph) == ["gpu", "spmd", "rl", "gpu"]
    assert _cycle({"gpu": {"rl"}, "rl": {"sampling"}, "sampling": set()}) is None


def test_the_scan_finds_a_circle_written_into_a_package(tmp_path: Path) -> None:
    # the real scan over files: data.cleaning importing data.adapters back (adapters imports cleaning)
    # was one of the two circles of issue 42
    pkg = tmp_path / "verl_core" / "data"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "adapters.py").write_text("from verl_core.data.cleaning import RawRow\n")
    (pkg / "cleaning.py").write_text("def f():\n    from verl_core.data import adapters\n")
    files = sorted(pkg.glob("*.py"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys.modules[__name__], "ROOT", tmp_path)
        assert _cycle(_graph(files)) == [
            "verl_core.data.adapters",
            "verl_core.data.cleaning",
            "verl_core.data.adapters",
        ]


def test_no_import_circle_in_the_four_packages() -> None:
    graph = _graph(FILES)
    assert {"verl_core.config.schema", "stages.floor.session", "flows.cli.run", "launcher.spmd"} <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, "an import circle: " + " → ".join(cycle or [])


ENTRY = re.compile(r"""\b(?:entry|flow)="([\w.]+:\w+)\"""")


@pytest.mark.parametrize("path", [p for p in FLOW_FILES if ENTRY.search(p.read_text())], ids=lambda p: p.name)
def test_spmd_entry_points_named_by_flows_resolve(path: Path) -> None:
    for name in ENTRY.findall(path.read_text()):
        assert callable(resolve(name)), name
