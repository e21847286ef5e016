"""Custom reward functions: loaded from ``package.module:function`` or ``path/to/file.py:function``,
called in the form their signature asks for, run with a timeout.

Loading. ``package.module:function`` is ``importlib.import_module`` + ``getattr`` (the module must be
importable: installed, or its directory on ``PYTHONPATH``); ``path/to/file.py:function`` (verl's
``custom_reward_function.path`` + ``.name``; a relative path is relative to the working directory)
loads that file once per process under a stable module name. A missing module or file, a missing
attribute or something not callable is a :class:`ConfigError` naming ``reward.function``.

Calling. ``mode`` (``reward.function_mode``) says one call per sample or per batch; within it the
signature, inspected once (:func:`verl_core.reward.call_forms.call_form`), says how: verl's keyword
forms (``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)``, its built-in
``compute_score(solution_str, ground_truth, ...)``, the batch manager's plural keywords) or the
positional form (``fn(completion, *, ground_truth, data_source, extra_info)``; batch: lists).

A sample's score is a number, or (as verl allows) a dict with the number under ``"score"``: its other
keys with numeric values are averaged over the batch into the scorer's metrics
(``reward/function/extra/{key}``); non-numeric ones are dropped, having no per-sample place in the
rewards table.

Timeouts. The function runs in a forked child process (it inherits the loaded function, so nothing
is pickled but the results); the parent waits at most ``timeout_s`` for each result - each sample in
``sample`` mode, the whole call in ``batch`` mode - and kills the child when the wait runs out, so a
hang costs ``timeout_s``, never the stage. In ``sample`` mode a fresh child continues with the next
sample. A raise, a timeout, a crash of the child or a return value that is not a score is recorded
as that sample's error (every sample's, in ``batch`` mode); the caller decides what an error means
(``reward.on_error``). Forking needs the ``fork`` start method (Linux, macOS); the child must not use
CUDA.

Error kinds (``FunctionScores.kinds``), for what a caller may do about an error:

* ``"broken"``: the code fails whatever it is given: it raised one of :data:`BROKEN_ERRORS` (a call
  that does not fit, a missing import or name) or returned something that is not a score. The
  preflight refuses such a function on its synthetic row.
* ``"code"``: the same call fails the same way again: one of :data:`CODE_ERRORS` (errors of the
  values the code was given: ``ValueError``, ``KeyError`` ...), which may depend on the row.
* ``"transient"``: may pass on a retry: a timeout, a dead child, ``OSError`` (network, files),
  ``RuntimeError`` and every other exception.

Retrying a ``broken`` or ``code`` error cannot help (:func:`is_deterministic`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import multiprocessing as mp
import re
import sys
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal, NamedTuple

from verl_core.errors import ConfigError, VerlFlowError
from verl_core.reward.call_forms import FILE_MODULE_PREFIX, FUNCTION_MODES, CallForm, FunctionMode, call_form

__all__ = [
    "BROKEN_ERRORS",
    "CODE_ERRORS",
    "FUNCTION_MODES",
    "ErrorKind",
    "FunctionInputs",
    "FunctionMode",
    "FunctionScores",
    "error_kind",
    "is_deterministic",
    "load_reward_function",
    "run_reward_function",
]

ErrorKind = Literal["broken", "code", "transient"]
# The code fails whatever its input (see the module doc, "Error kinds")
BROKEN_ERRORS: tuple[type[BaseException], ...] = (TypeError, ImportError, NameError, SyntaxError)
# Raised again by the same code on the same input (no I/O involved), maybe not on another input
CODE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    LookupError,  # KeyError, IndexError
    AttributeError,
    ArithmeticError,  # ZeroDivisionError, OverflowError
    NotImplementedError,
    AssertionError,
)
SPEC_FORMS = "'package.module:function' or 'path/to/file.py:function'"


class FunctionInputs(NamedTuple):
    """B samples as a custom reward function sees them."""

    completions: list[str]
    ground_truths: list[str]
    data_sources: list[str]
    extra_infos: list[dict[str, Any]]


class FunctionScores(NamedTuple):
    """``scores (B,)`` (0.0 where the sample failed), ``errors (B,)``: None or what went wrong,
    ``kinds (B,)``: the error's kind (module doc; None without an error), ``extras (B,)``: the numeric
    extra keys of a dict return (empty otherwise)."""

    scores: list[float]
    errors: list[str | None]
    kinds: list[ErrorKind | None]
    extras: list[dict[str, float]]


def error_kind(e: BaseException) -> ErrorKind:
    """The kind of an exception the function raised (module doc)."""
    if isinstance(e, BROKEN_ERRORS):
        return "broken"
    return "code" if isinstance(e, CODE_ERRORS) else "transient"


def is_deterministic(kind: ErrorKind | None) -> bool:
    """Whether an error of ``kind`` happens again on the same input (no retry can help)."""
    return kind in ("broken", "code")


def load_reward_function(spec: str) -> Callable[..., Any]:
    """The callable at ``spec``: ``"package.module:function"`` (attribute paths ``mod:Class.method``
    work too) or ``"path/to/file.py:function"`` (relative to the working directory)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(f"reward.function: got {spec!r}, expected {SPEC_FORMS}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(where, spec)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(
                f"reward.function: cannot import module {where!r} ({e}); put its directory on "
                f"PYTHONPATH, or give the file: 'path/to/file.py:{attr}'"
            ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ConfigError(
                f"reward.function: {where!r} has no attribute {attr!r}; "
                f"callables there: {', '.join(names) or 'none'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"reward.function: {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def _load_file(where: str, spec: str) -> Any:
    """The module of the Python file ``where``, executed once per process under a name made from its
    absolute path (so a second load, or a second scorer naming it, gets the same module)."""
    path = Path(where).expanduser()
    path = (path if path.is_absolute() else Path.cwd() / path).resolve()
    if not path.is_file():
        raise ConfigError(
            f"reward.function: {spec!r}: no file {path} (a relative path is relative to the working "
            f"directory); expected {SPEC_FORMS}"
        )
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    name = f"{FILE_MODULE_PREFIX}{digest}_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    file_spec = importlib.util.spec_from_file_location(name, path)
    if file_spec is None or file_spec.loader is None:
        raise ConfigError(f"reward.function: {spec!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[name] = module  # before running it, as an import does (dataclasses, pickling look it up)
    try:
        file_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"reward.function: loading {path} failed ({type(e).__name__}: {e})") from None
    return module


def run_reward_function(
    fn: Callable[..., Any],
    inputs: FunctionInputs,
    *,
    mode: FunctionMode,
    timeout_s: float,
    form: CallForm | None = None,
) -> FunctionScores:
    """Call ``fn`` on the B samples of ``inputs`` in a child process with a timeout (see module doc),
    in ``form`` (None: inspect ``fn`` now, :func:`~verl_core.reward.call_forms.call_form`)."""
    form = form if form is not None else call_form(fn, mode)
    n = len(inputs.completions)
    if n == 0:
        return FunctionScores([], [], [], [])
    if mode == "batch":
        return _run_batch(fn, form, inputs, timeout_s)
    out = FunctionScores([0.0] * n, [None] * n, [None] * n, [{} for _ in range(n)])
    start = 0
    while start < n:  # one child per run of samples; a new one after a timeout or a crash
        start = _run_samples(fn, form, inputs, start, timeout_s, out)
    return out


def _as_score(value: Any) -> tuple[float, dict[str, float]]:
    """``(score, numeric extras)`` of a number, or of a dict with the number under ``"score"``."""
    extras: dict[str, float] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise TypeError(f"returned a dict without 'score' (keys {sorted(map(str, value))})")
        extras = {
            str(k): float(v)
            for k, v in value.items()
            if k != "score" and isinstance(v, int | float) and math.isfinite(float(v))
        }
        value = value["score"]
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"returned {value!r}, expected a number") from None
    if not math.isfinite(out):
        raise ValueError(f"returned {out}, expected a finite number")
    return out, extras


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _context() -> Any:
    if "fork" not in mp.get_all_start_methods():
        raise VerlFlowError("reward.function: running a custom function needs the 'fork' start method")
    return mp.get_context("fork")


def _values(inputs: FunctionInputs, i: int) -> dict[str, Any]:
    return {
        "completion": inputs.completions[i],
        "ground_truth": inputs.ground_truths[i],
        "data_source": inputs.data_sources[i],
        "extra_info": inputs.extra_infos[i],
    }


def _sample_child(
    fn: Callable[..., Any], form: CallForm, inputs: FunctionInputs, start: int, conn: Connection
) -> None:
    for i in range(start, len(inputs.completions)):
        try:
            args, kwargs = form.arguments(_values(inputs, i))
            score, extras = _as_score(fn(*args, **kwargs))
            conn.send((i, score, None, None, extras))
        except BaseException as e:
            conn.send((i, 0.0, _describe(e), error_kind(e), {}))
    conn.close()


def _run_samples(
    fn: Callable[..., Any],
    form: CallForm,
    inputs: FunctionInputs,
    start: int,
    timeout_s: float,
    out: FunctionScores,
) -> int:
    """Score samples ``start..`` in one child until all are done or one fails to answer, into ``out``;
    returns the next sample to score."""
    recv, send = _context().Pipe(duplex=False)
    child = _context().Process(target=_sample_child, args=(fn, form, inputs, start, send), daemon=True)
    child.start()
    send.close()
    i = start
    try:
        while i < len(inputs.completions):
            if not recv.poll(timeout_s):
                out.errors[i], out.kinds[i] = f"timed out after {timeout_s:g} s", "transient"
                return i + 1
            try:
                j, score, error, kind, extras = recv.recv()
            except EOFError:
                out.errors[i] = f"the worker process died (exit code {child.exitcode})"
                out.kinds[i] = "transient"
                return i + 1
            out.scores[j], out.errors[j], out.kinds[j], out.extras[j] = score, error, kind, extras
            i = j + 1
        return i
    finally:
        _stop(child)
        recv.close()


def _batch_child(fn: Callable[..., Any], form: CallForm, inputs: FunctionInputs, conn: Connection) -> None:
    try:
        args, kwargs = form.arguments(
            {
                "completion": list(inputs.completions),
                "ground_truth": list(inputs.ground_truths),
                "data_source": list(inputs.data_sources),
                "extra_info": list(inputs.extra_infos),
            }
        )
        values = list(fn(*args, **kwargs))
        if len(values) != len(inputs.completions):
            raise ValueError(f"returned {len(values)} scores for {len(inputs.completions)} completions")
        conn.send(([_as_score(v) for v in values], None, None))
    except BaseException as e:
        conn.send((None, _describe(e), error_kind(e)))
    conn.close()


def _run_batch(
    fn: Callable[..., Any], form: CallForm, inputs: FunctionInputs, timeout_s: float
) -> FunctionScores:
    n = len(inputs.completions)
    recv, send = _context().Pipe(duplex=False)
    child = _context().Process(target=_batch_child, args=(fn, form, inputs, send), daemon=True)
    child.start()
    send.close()
    kind: ErrorKind | None = "transient"
    try:
        if not recv.poll(timeout_s):
            error: str | None = f"timed out after {timeout_s:g} s (batch of {n})"
            values = None
        else:
            try:
                values, error, kind = recv.recv()
            except EOFError:
                values, error = None, f"the worker process died (exit code {child.exitcode})"
    finally:
        _stop(child)
        recv.close()
    if values is None:
        return FunctionScores([0.0] * n, [error] * n, [kind] * n, [{} for _ in range(n)])
    return FunctionScores([v[0] for v in values], [None] * n, [None] * n, [v[1] for v in values])


def _stop(child: Any) -> None:
    if child.is_alive():
        child.kill()
    child.join()
