"""A static scan of the project's code for ways to run code we did not write or configure:
unrestricted unpickling, ``trust_remote_code`` switched on by default, ``eval``/``exec``, and
dynamic imports outside the one place that loads the configured reward function.

Works on the AST (not text), so comments and docstrings that *mention* ``pickle.load`` do not count,
and a ``torch.load`` passes only with the literal keyword ``weights_only=True``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

# Calls that unpickle (or unmarshal) without restriction: module → functions.
UNSAFE_CALLS = {
    "pickle": {"load", "loads", "Unpickler"},
    "cPickle": {"load", "loads", "Unpickler"},
    "_pickle": {"load", "loads", "Unpickler"},
    "dill": {"load", "loads"},
    "cloudpickle": {"load", "loads"},
    "joblib": {"load"},
    "marshal": {"load", "loads"},
    "shelve": {"open"},
    "pd": {"read_pickle"},
    "pandas": {"read_pickle"},
    "yaml": {"unsafe_load", "unsafe_load_all", "full_load", "full_load_all"},
}
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal"}
DYNAMIC_IMPORTS = {
    "importlib.import_module",
    "__import__",
    "importlib.util.spec_from_file_location",
    "runpy.run_path",
    "runpy.run_module",
}
# The one sanctioned dynamic import: ``reward.function`` ('package.module:function') from the config.
DYNAMIC_IMPORT_ALLOWED = {"verl_core/reward/functions.py"}


class Finding(NamedTuple):
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def scan_source(source: str, path: str) -> list[Finding]:
    """Findings in one file's source (``path`` is used for messages and the allow-list)."""
    tree = ast.parse(source, filename=path)
    found: list[Finding] = []

    def add(node: ast.AST, what: str) -> None:
        found.append(Finding(path, getattr(node, "lineno", 0), what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UNSAFE_MODULES:
                    add(node, f"imports {alias.name} (unrestricted deserialisation)")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            add(node, f"imports from {node.module} (unrestricted deserialisation)")
        elif isinstance(node, ast.Call):
            found.extend(_check_call(node, path))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.extend(_check_defaults(node, path))
        elif isinstance(node, ast.AnnAssign) and _dotted(node.target) == "trust_remote_code":
            # a pydantic/dataclass field: `trust_remote_code: bool = True` or `= Field(True, ...)`
            value = node.value
            if _is_true(value) or (isinstance(value, ast.Call) and value.args and _is_true(value.args[0])):
                add(node, "trust_remote_code defaults to True")
    return found


def _check_call(call: ast.Call, path: str) -> Iterator[Finding]:
    name = _dotted(call.func)
    module, _, func = name.rpartition(".")
    line = call.lineno
    if name == "torch.load" and not _is_true(_kw(call, "weights_only")):
        yield Finding(path, line, "torch.load without weights_only=True")
    if module.split(".")[-1] in UNSAFE_CALLS and func in UNSAFE_CALLS[module.split(".")[-1]]:
        yield Finding(path, line, f"{name}() deserialises without restriction")
    if name in ("np.load", "numpy.load") and _is_true(_kw(call, "allow_pickle")):
        yield Finding(path, line, f"{name}(allow_pickle=True)")
    if name == "yaml.load":
        loader = _dotted(_kw(call, "Loader") or (call.args[1] if len(call.args) > 1 else ast.Constant(None)))
        if not loader.endswith(("SafeLoader", "CSafeLoader")):
            yield Finding(path, line, "yaml.load without a SafeLoader")
    if name in ("eval", "exec", "builtins.eval", "builtins.exec"):
        yield Finding(path, line, f"{name}() runs arbitrary code")
    if _is_true(_kw(call, "trust_remote_code")):
        yield Finding(path, line, "trust_remote_code=True hard-coded")
    if name in DYNAMIC_IMPORTS and path not in DYNAMIC_IMPORT_ALLOWED:
        yield Finding(path, line, f"{name}() outside the configured reward-function loader")


def _check_defaults(fn: ast.FunctionDef | ast.AsyncFunctionDef, path: str) -> Iterator[Finding]:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
    for arg, default in pairs:
        if arg.arg == "trust_remote_code" and _is_true(default):
            yield Finding(path, fn.lineno, f"{fn.name}(trust_remote_code=True) default")


def python_files(root: Path, packages: Iterable[str]) -> list[Path]:
    files: list[Path] = []
    for pkg in packages:
        base = root / pkg
        if base.is_file():
            files.append(base)
        elif base.is_dir():
            files.extend(p for p in sorted(base.rglob("*.py")) if ".venv" not in p.parts)
    return files


def scan_tree(root: Path, packages: Iterable[str]) -> list[Finding]:
    out: list[Finding] = []
    for path in python_files(root, packages):
        rel = path.relative_to(root).as_posix()
        out.extend(scan_source(path.read_text(encoding="utf-8"), rel))
    return out
