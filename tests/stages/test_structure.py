"""The shape the stages keep (issue 29), checked by an AST scan: a stage body carries no rank logic
(the SPMD pattern is the floor's, :mod:`stages.floor.spmd`), a stage's entry point stays short enough
to read as numbered steps, and the RL state changes only through the floor functions of
:mod:`stages.floor.state` (flows and stages read it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGE_FILES = sorted((ROOT / "stages").glob("*.py"))
STATE_FILE = ROOT / "stages" / "floor" / "state.py"
SCANNED = [
    p
    for p in sorted((ROOT / "stages").rglob("*.py")) + sorted((ROOT / "flows").rglob("*.py"))
    if p != STATE_FILE
]
RANK_NAMES = {
    "is_main",
    "broadcast_from_main",
    "on_main",
    "rank0_to_main",
    "gather_to_main",
    "all_gather",
    "world_size",
    "rank",
    "main_rank",
}
MAX_ENTRY_LINES = 80
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "add", "discard"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _rank_mentions(source: str) -> list[str]:
    """``line: name`` of every import of ``verl_core.runtime.ranks`` and every rank-aware name
    (a call, an attribute, an imported name) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}" for a in node.names if a.name.endswith("runtime.ranks")
            ]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.endswith("runtime.ranks") or (
                module.endswith("runtime") and "ranks" in {a.name for a in node.names}
            ):
                found.append(f"{node.lineno}: from {module} import ...")
            found += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in RANK_NAMES]
        elif isinstance(node, ast.Name) and node.id in RANK_NAMES:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in RANK_NAMES:
            found.append(f"{node.lineno}: .{node.attr}")
    return found


def _is_task(decorator: ast.expr) -> bool:
    """``@task``, ``@task(...)``, ``@prefect.task(...)``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Name) and target.id == "task") or (
        isinstance(target, ast.Attribute) and target.attr == "task"
    )


def _long_tasks(source: str) -> list[str]:
    """``name: N lines`` of every ``@task`` function over :data:`MAX_ENTRY_LINES` (``def`` line to
    its last line, docstring included)."""
    long = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and any(_is_task(d) for d in node.decorator_list):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_ENTRY_LINES:
                long.append(f"{node.name}: {lines} lines")
    return long


def _state_fields() -> set[str]:
    """The fields of ``RLState`` (its annotated class attributes)."""
    tree = ast.parse(STATE_FILE.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RLState")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _is_get_state(node: ast.expr) -> bool:
    func = node.func if isinstance(node, ast.Call) else None
    return (isinstance(func, ast.Name) and func.id == "get_state") or (
        isinstance(func, ast.Attribute) and func.attr == "get_state"
    )


def _state_writes(source: str, fields: set[str]) -> list[str]:
    """``line: text`` of every write into an RL state field: ``get_state(...).f = ``, ``state.f = ``
    (a name bound to ``get_state(...)`` or called ``state``), ``+=``, item assignment, and a mutating
    method call (``state.pending.append(...)``)."""
    tree = ast.parse(source)
    names = {"state"}
    for node in ast.walk(tree):  # names bound to get_state(...), tuple unpacking included
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and _is_get_state(node.value):
                    names.add(target.id)
                elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for t, v in zip(target.elts, node.value.elts, strict=False):
                        if isinstance(t, ast.Name) and _is_get_state(v):
                            names.add(t.id)

    def field_of_state(node: ast.expr) -> bool:
        while isinstance(node, ast.Subscript):  # state.pending[0] = ...
            node = node.value
        if not (isinstance(node, ast.Attribute) and node.attr in fields):
            return False
        owner = node.value
        return _is_get_state(owner) or (isinstance(owner, ast.Name) and owner.id in names)

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [
                t
                for target in node.targets
                for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            ]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
        ):
            targets = [node.func.value]
        found += [(node.lineno, ast.unparse(t)) for t in targets if field_of_state(t)]
    return [f"{line}: {text}" for line, text in sorted(found)]


@pytest.mark.parametrize("path", STAGE_FILES, ids=_rel)
def test_no_stage_body_mentions_a_rank(path: Path) -> None:
    """Rank-aware helpers live in the floor (``committed``, ``commit_once``, ``main_value``)."""
    assert _rank_mentions(path.read_text()) == []


@pytest.mark.parametrize("path", STAGE_FILES, ids=_rel)
def test_every_stage_entry_point_is_short(path: Path) -> None:
    """A ``@task`` reads as numbered steps; reading and writing pieces move to helpers."""
    assert _long_tasks(path.read_text()) == []


@pytest.mark.parametrize("path", SCANNED, ids=_rel)
def test_the_rl_state_changes_only_in_its_floor_module(path: Path) -> None:
    """Flows and stages read the RL state; a change goes through a function of stages.floor.state
    (``advance_policy``, ``seal_update``, ``set_prompt_cursor``)."""
    assert _state_writes(path.read_text(), _state_fields()) == []


def test_the_scans_catch_what_they_forbid() -> None:
    """Each scan flags a line that breaks its rule (so a silent scan means something)."""
    fields = _state_fields()
    assert {"version", "prompt_cursor", "pending"} <= fields
    writes = """
s = get_state(ctx)
get_state(ctx).prompt_cursor = 3
s.version = 1
store, rl = ctx.store(), get_state(ctx)
rl.pending.append(m)
state.version += 1
other.version = 2
"""
    assert _state_writes(writes, fields) == [
        "3: get_state(ctx).prompt_cursor",
        "4: s.version",
        "6: rl.pending",
        "7: state.version",
    ]
    ranks = "from verl_core.runtime.ranks import is_main\nif ranks.rank() == 0:\n    pass\n"
    assert _rank_mentions(ranks) == [
        "1: from verl_core.runtime.ranks import ...",
        "1: imports is_main",
        "2: .rank",
    ]
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_ENTRY_LINES))
    assert _long_tasks(f"@task(name='t')\ndef t():\n{body}\n") == ["t: 81 lines"]
    assert _long_tasks(f"def f():\n{body}\n") == []
