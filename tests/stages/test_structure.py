"""The shape the stages keep (issues 29, 42), checked by an AST scan: a stage body carries no rank logic
(the SPMD pattern is the floor's, :mod:`stages.floor.commit`), a stage's entry point stays short enough
to read as numbered steps, the RL session changes only through the floor functions of
:mod:`stages.floor.session` (and its opening and checkpoint modules; flows and stages read it), an RL
task shell looks its session up once and hands it to its body, and no module keeps models or scorers
in a module-level container (the session holds them, and the loop hands it down)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGE_FILES = sorted((ROOT / "stages").glob("*.py"))
SESSION_FILE = ROOT / "stages" / "floor" / "session.py"
SESSION_WRITERS = {SESSION_FILE, *(ROOT / "stages" / "floor" / f for f in ("opening.py", "checkpoint.py"))}
SCANNED = [
    p
    for p in sorted((ROOT / "stages").rglob("*.py")) + sorted((ROOT / "flows").rglob("*.py"))
    if p not in SESSION_WRITERS
]
PACKAGES = [p for d in ("stages", "flows", "verl_core") for p in sorted((ROOT / d).rglob("*.py"))]
# what a module-level container must not hold: the RL session and what it is made of
HELD_TYPES = {
    "RLSession", "RLState", "SessionSlot", "Module", "PackedCausalLM", "PackedScoreModel", "LogProbModel",
    "TrainEngine", "RolloutEngine", "WeightedScorer", "Scorer", "Tensor", "PreTrainedModel",
}  # fmt: skip
CONTAINER_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakValueDictionary"}
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
    """The fields of ``RLSession`` (its annotated class attributes)."""
    tree = ast.parse(SESSION_FILE.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RLSession")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _called(node: ast.AST | None, name: str) -> bool:
    """``name(...)`` or ``x.name(...)``."""
    func = node.func if isinstance(node, ast.Call) else None
    return (isinstance(func, ast.Name) and func.id == name) or (
        isinstance(func, ast.Attribute) and func.attr == name
    )


def _is_get_state(node: ast.expr) -> bool:
    """A session lookup: ``session_of(...)`` (the task shells'), or the removed ``get_state(...)``."""
    return _called(node, "session_of") or _called(node, "get_state")


def _state_writes(source: str, fields: set[str]) -> list[str]:
    """``line: text`` of every write into an RL session field: ``session_of(...).f = ``, ``session.f =``
    (a name bound to a session lookup or called ``session`` or ``state``), ``+=``, item assignment,
    and a mutating method call (``session.pending.append(...)``)."""
    tree = ast.parse(source)
    names = {"state", "session"}
    for node in ast.walk(tree):  # names bound to a session lookup, tuple unpacking included
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


def _held_containers(source: str) -> list[str]:
    """``line: name`` of every module-level container that starts empty and is filled at run time (a
    cache, a registry of live objects: ``{}``, ``[]``, ``set()``, ``defaultdict(...)``) and may hold
    models, engines, scorers or sessions: its annotation names one of :data:`HELD_TYPES`, or it has
    none (what it holds is unsaid)."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value, annotation = node.targets[0], node.value, None
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value, annotation = node.target, node.value, node.annotation
        else:
            continue
        empty = (
            isinstance(value, (ast.Dict, ast.List, ast.Set)) and not ast.unparse(value)[1:-1].strip()
        ) or (
            isinstance(value, ast.Call)
            and any(_called(value, c) for c in CONTAINER_CALLS)
            and not (
                value.args
                and isinstance(value.args[0], (ast.Dict, ast.List))
                and ast.unparse(value.args[0])[1:-1]
            )
        )
        if not empty or not isinstance(target, ast.Name):
            continue
        named = set() if annotation is None else {
            n.id if isinstance(n, ast.Name) else n.attr
            for n in ast.walk(annotation) if isinstance(n, (ast.Name, ast.Attribute))
        }  # fmt: skip
        if annotation is None or named & HELD_TYPES:
            found.append(f"{node.lineno}: {target.id}")
    return found


def _session_lookups(source: str) -> list[str]:
    """``line: function`` of every session lookup outside an RL task shell, and of every task shell
    that looks it up more than once (a task shell looks it up once and hands it to its body), and of
    every mention of the removed ``get_state``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            lookups = [n for n in ast.walk(node) if _called(n, "session_of")]
            shell = any(_is_task(d) for d in node.decorator_list)
            if lookups and (not shell or len(lookups) > 1):
                found.append(f"{node.lineno}: {node.name}")
            if node.name == "get_state":
                found.append(f"{node.lineno}: def get_state")
        elif isinstance(node, ast.Name) and node.id == "get_state":
            found.append(f"{node.lineno}: get_state")
        elif isinstance(node, ast.alias) and node.name == "get_state":
            found.append(f"{getattr(node, 'lineno', 0)}: imports get_state")
    return found


@pytest.mark.parametrize("path", SCANNED, ids=_rel)
def test_the_rl_session_changes_only_in_its_floor_modules(path: Path) -> None:
    """Flows and stages read the RL session; a change goes through a function of
    stages.floor.session (``advance_policy``, ``seal_update``, ``set_prompt_cursor``) or the
    checkpoint's (``save_checkpoint``)."""
    assert _state_writes(path.read_text(), _state_fields()) == []


@pytest.mark.parametrize("path", PACKAGES, ids=_rel)
def test_no_module_keeps_models_or_scorers_in_a_module_level_container(path: Path) -> None:
    """The RL session holds the models, engines and scorers of a run; the loop opens it, binds it for
    its task shells and closes it. A module-level dict keyed by run id would hide that state again."""
    assert _held_containers(path.read_text()) == []


@pytest.mark.parametrize("path", SCANNED, ids=_rel)
def test_only_an_rl_task_shell_looks_the_session_up_and_once(path: Path) -> None:
    """Stage bodies and flow helpers receive the session as a parameter; ``get_state`` is gone."""
    assert _session_lookups(path.read_text()) == []


def test_the_scans_catch_what_they_forbid() -> None:
    """Each scan flags a line that breaks its rule (so a silent scan means something)."""
    fields = _state_fields()
    assert {"version", "prompt_cursor", "pending"} <= fields
    writes = """
s = session_of(ctx)
session_of(ctx).prompt_cursor = 3
s.version = 1
store, rl = ctx.store(), session_of(ctx)
rl.pending.append(m)
session.version += 1
other.version = 2
"""
    assert _state_writes(writes, fields) == [
        "3: session_of(ctx).prompt_cursor",
        "4: s.version",
        "6: rl.pending",
        "7: session.version",
    ]
    containers = """
_STATES: dict[str, RLSession] = {}
_RUN_SCORERS: dict[str, dict[str, list[WeightedScorer]]] = {}
_MODELS: defaultdict[str, list[nn.Module]] = defaultdict(list)
_CACHE = {}
_LINES: dict[str, float] = {}
NAMES = {"a": "b"}
ORDER = [1, 2]
_BOUND: ContextVar[SessionSlot | None] = ContextVar("s", default=None)
"""
    assert _held_containers(containers) == ["2: _STATES", "3: _RUN_SCORERS", "4: _MODELS", "5: _CACHE"]
    lookups = """
@task(name="rollout")
def rollout(ctx):
    return body(session_of(ctx), ctx)
@task(name="twice")
def twice(ctx):
    return body(session_of(ctx), session_of(ctx))
def body(session, ctx):
    return session_of(ctx).version
from stages.floor.state import get_state
"""
    assert _session_lookups(lookups) == ["6: twice", "8: body", "10: imports get_state"]
    ranks = "from verl_core.runtime.ranks import is_main\nif ranks.rank() == 0:\n    pass\n"
    assert _rank_mentions(ranks) == [
        "1: from verl_core.runtime.ranks import ...",
        "1: imports is_main",
        "2: .rank",
    ]
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_ENTRY_LINES))
    assert _long_tasks(f"@task(name='t')\ndef t():\n{body}\n") == ["t: 81 lines"]
    assert _long_tasks(f"def f():\n{body}\n") == []
