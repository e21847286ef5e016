"""Every config key is read by the code and named by a test, or it is deleted.

A key is *read* when some module of ``verl_core/``, ``stages/``, ``flows/`` or ``launcher/`` reads it
as an attribute of its section (an AST search, see :class:`_Reads`; checking in a validator is not
reading); keys only read dynamically are listed in :data:`READ_DYNAMICALLY` with the place that reads
them. A key is *named by a test* when a file under ``tests/`` holds its dotted path
(``actor.clip_ratio_c``, an override or a YAML path) or its field name beside its section's name or
class (``DataConfig(arithmetic_ops=...)``, ``cfg.actor.clip_ratio_c``)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import typing
from collections import defaultdict
from pathlib import Path

from pydantic import BaseModel

from verl_core.config import VerlFlowConfig

REPO = Path(__file__).resolve().parents[3]
CODE = ("verl_core", "stages", "flows", "launcher")

# Keys the AST search cannot see, each with the place that reads it. Empty today: keep it short.
READ_DYNAMICALLY: dict[str, str] = {}


def _section(annotation: object) -> type[BaseModel] | None:
    for cand in (annotation, *typing.get_args(annotation)):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
    return None


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
    ``getattr(<...>.section, name)`` reads every field named by a string literal of the file;
    ``_spec_from(Spec, section, **given)`` (stages/floor/specs.py: a spec dataclass filled from the
    section's fields of the same names) reads every field of ``Spec`` not in ``given``.
    Validators (``@model_validator`` / ``@field_validator``) do not count: checking is not using."""

    def __init__(self, classes: set[str]) -> None:
        self.classes, self.bound, self.reads = classes, defaultdict(set), set()
        self.pending: list[tuple[str, str]] = []  # (name, field), resolved once every binding is known
        self.dynamic: set[str] = set()  # sections read as getattr(<...>.section, name)
        self.strings: set[str] = set()  # string literals, the names such getattr calls may use
        self.specs: list[tuple[str, ast.expr, set[str]]] = []  # _spec_from(Spec, section, **given)

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
        if isinstance(func, ast.Name) and func.id == "_spec_from" and isinstance(args[0], ast.Name):
            self.specs.append((args[0].id, args[1], {k.arg for k in node.keywords if k.arg}))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            self.strings.add(node.value)

    def resolved(self, module: str) -> set[tuple[str, str]]:
        bound = {(tag, f) for name, f in self.pending for tag in self.bound.get(name, ())}
        specs = set()
        for spec, section, given in self.specs:
            fields = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), spec))}
            tags = {"." + section.attr} if isinstance(section, ast.Attribute) else set()
            if isinstance(section, ast.Name):
                tags = self.bound.get(section.id, set())
            specs |= {(tag, f) for tag in tags for f in fields - given}
        return self.reads | bound | specs | {(tag, s) for tag in self.dynamic for s in self.strings}


def _qualified_reads(classes: set[str]) -> set[tuple[str, str]]:
    reads: set[tuple[str, str]] = set()
    for folder in CODE:
        for path in sorted((REPO / folder).rglob("*.py")):
            visitor = _Reads(classes)
            visitor.visit(ast.parse(path.read_text()))
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            reads |= visitor.resolved(module)
    return reads


def test_every_config_key_is_read_somewhere() -> None:
    owners = _owners(VerlFlowConfig)
    assert set(READ_DYNAMICALLY) <= set(owners), "a listed key is gone: drop it from READ_DYNAMICALLY"
    reads = _qualified_reads({cls for cls, _, _ in owners.values()})

    def is_read(leaf: str) -> bool:
        cls, section, name = owners[leaf]
        return ("." + section, name) in reads or (cls, name) in reads

    unread = [leaf for leaf in owners if not is_read(leaf) and leaf not in READ_DYNAMICALLY]
    assert unread == [], f"keys no code reads (wire them, or delete them from the schema): {unread}"
    seen = [leaf for leaf in READ_DYNAMICALLY if is_read(leaf)]
    assert seen == [], f"read as attributes now, drop from READ_DYNAMICALLY: {seen}"


def _test_texts() -> list[str]:
    paths = [*(REPO / "tests").rglob("*.py"), *(REPO / "tests").rglob("*.yaml")]
    return [p.read_text() for p in sorted(paths)]


def test_every_config_key_is_named_in_a_test() -> None:
    texts = _test_texts()

    def named(leaf: str, cls: str, section: str, name: str) -> bool:
        word = re.compile(rf"\b{re.escape(name)}\b")
        context = re.compile(rf"\b({re.escape(cls)}|{re.escape(section)})\b")
        return any(leaf in t or (word.search(t) and context.search(t)) for t in texts)

    unnamed = [leaf for leaf, owner in _owners(VerlFlowConfig).items() if not named(leaf, *owner)]
    assert unnamed == [], f"keys no test names (add a test that reads or sets them): {unnamed}"
