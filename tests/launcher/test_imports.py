"""The launcher sits below the flows: an AST scan of every import in launcher/ (inside functions too)
finds none of ``flows`` or ``stages``. What an SPMD job runs reaches it as an import path string."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_FILES = sorted((ROOT / "launcher").rglob("*.py"))
ABOVE = ("flows", "stages")


def _top_packages(source: str) -> list[tuple[int, str]]:
    """``(line, top-level package)`` of every absolute import (relative ones stay in the launcher)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_the_scan_sees_imports_inside_functions() -> None:
    source = "import os\n\ndef run():\n    from flows.gpu import rl_rank\n    import stages.sft\n"
    assert _top_packages(source) == [(1, "os"), (4, "flows"), (5, "stages")]


def test_the_scan_sees_the_launcher() -> None:
    assert {p.stem for p in LAUNCHER_FILES} >= {"__init__", "spmd", "follow", "run_log", "prefect_api"}


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_the_launcher_imports_neither_flows_nor_stages(path: Path) -> None:
    found = _top_packages(path.read_text())
    bad = [f"{path.relative_to(ROOT)}:{line}: imports {top}" for line, top in found if top in ABOVE]
    assert not bad, "launcher/ imports verl_core and Prefect, never flows or stages:\n" + "\n".join(bad)
