"""Custom reward functions: loaded from an explicit ``package.module:function`` path, run with a timeout.

Two forms, chosen by ``mode`` (``reward.function_mode``), never guessed from the signature:

``batch`` (TRL's reward-function form, one call for the whole batch)::

    def my_reward(completions: list[str], *, ground_truths: list[str], data_sources: list[str],
                  extra_infos: list[dict]) -> list[float]

``sample`` (verl's ``compute_score`` form, one call per response)::

    def my_reward(completion: str, *, ground_truth: str, data_source: str, extra_info: dict) -> float

Loading is ``importlib.import_module`` + ``getattr``: nothing is evaluated, and a missing module, a
missing attribute or something not callable is a :class:`ConfigError` naming ``reward.function``.

Timeouts. The function runs in a forked child process (it inherits the loaded function, so nothing
is pickled but the results); the parent waits at most ``timeout_s`` for each result - each sample in
``sample`` mode, the whole call in ``batch`` mode - and kills the child when the wait runs out, so a
hang costs ``timeout_s``, never the stage. In ``sample`` mode a fresh child continues with the next
sample. A raise, a timeout, a crash of the child or a return value that is not a number is recorded
as that sample's error (every sample's, in ``batch`` mode); the caller decides what an error means
(``reward.on_error``). Forking needs the ``fork`` start method (Linux, macOS); the child must not use
CUDA.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing as mp
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Literal, NamedTuple

from verl_core.errors import ConfigError, VerlFlowError

FunctionMode = Literal["batch", "sample"]
FUNCTION_MODES: tuple[FunctionMode, ...] = ("batch", "sample")


class FunctionInputs(NamedTuple):
    """B samples as a custom reward function sees them."""

    completions: list[str]
    ground_truths: list[str]
    data_sources: list[str]
    extra_infos: list[dict[str, Any]]


class FunctionScores(NamedTuple):
    """``scores (B,)`` (0.0 where the sample failed) and ``errors (B,)``: None or what went wrong."""

    scores: list[float]
    errors: list[str | None]


def load_reward_function(path: str) -> Callable[..., Any]:
    """The callable at ``"package.module:function"`` (attribute paths ``mod:Class.method`` work too)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"reward.function: got {path!r}, expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"reward.function: cannot import module {module_name!r} ({e})") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ConfigError(
                f"reward.function: module {module_name!r} has no attribute {attr!r}; "
                f"callables there: {', '.join(names) or 'none'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"reward.function: {path!r} is a {type(obj).__name__}, not a callable")
    return obj


def run_reward_function(
    fn: Callable[..., Any], inputs: FunctionInputs, *, mode: FunctionMode, timeout_s: float
) -> FunctionScores:
    """Call ``fn`` on the B samples of ``inputs`` in a child process with a timeout (see module doc)."""
    if mode not in FUNCTION_MODES:
        raise ConfigError(f"reward.function_mode: got {mode!r}, expected one of {', '.join(FUNCTION_MODES)}")
    n = len(inputs.completions)
    if n == 0:
        return FunctionScores([], [])
    if mode == "batch":
        return _run_batch(fn, inputs, timeout_s)
    scores: list[float] = [0.0] * n
    errors: list[str | None] = [None] * n
    start = 0
    while start < n:  # one child per run of samples; a new one after a timeout or a crash
        start = _run_samples(fn, inputs, start, timeout_s, scores, errors)
    return FunctionScores(scores, errors)


def _as_score(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"returned {value!r}, expected a number") from None
    if not math.isfinite(out):
        raise ValueError(f"returned {out}, expected a finite number")
    return out


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _context() -> Any:
    if "fork" not in mp.get_all_start_methods():
        raise VerlFlowError("reward.function: running a custom function needs the 'fork' start method")
    return mp.get_context("fork")


def _sample_child(fn: Callable[..., Any], inputs: FunctionInputs, start: int, conn: Connection) -> None:
    for i in range(start, len(inputs.completions)):
        try:
            value = fn(
                inputs.completions[i],
                ground_truth=inputs.ground_truths[i],
                data_source=inputs.data_sources[i],
                extra_info=inputs.extra_infos[i],
            )
            conn.send((i, _as_score(value), None))
        except BaseException as e:
            conn.send((i, 0.0, _describe(e)))
    conn.close()


def _run_samples(
    fn: Callable[..., Any],
    inputs: FunctionInputs,
    start: int,
    timeout_s: float,
    scores: list[float],
    errors: list[str | None],
) -> int:
    """Score samples ``start..`` in one child until all are done or one fails to answer; returns the
    next sample to score."""
    recv, send = _context().Pipe(duplex=False)
    child = _context().Process(target=_sample_child, args=(fn, inputs, start, send), daemon=True)
    child.start()
    send.close()
    i = start
    try:
        while i < len(inputs.completions):
            if not recv.poll(timeout_s):
                errors[i] = f"timed out after {timeout_s:g} s"
                return i + 1
            try:
                j, value, error = recv.recv()
            except EOFError:
                errors[i] = f"the worker process died (exit code {child.exitcode})"
                return i + 1
            scores[j], errors[j] = value, error
            i = j + 1
        return i
    finally:
        _stop(child)
        recv.close()


def _batch_child(fn: Callable[..., Any], inputs: FunctionInputs, conn: Connection) -> None:
    try:
        values = fn(
            list(inputs.completions),
            ground_truths=list(inputs.ground_truths),
            data_sources=list(inputs.data_sources),
            extra_infos=list(inputs.extra_infos),
        )
        values = list(values)
        if len(values) != len(inputs.completions):
            raise ValueError(f"returned {len(values)} scores for {len(inputs.completions)} completions")
        conn.send(([_as_score(v) for v in values], None))
    except BaseException as e:
        conn.send((None, _describe(e)))
    conn.close()


def _run_batch(fn: Callable[..., Any], inputs: FunctionInputs, timeout_s: float) -> FunctionScores:
    n = len(inputs.completions)
    recv, send = _context().Pipe(duplex=False)
    child = _context().Process(target=_batch_child, args=(fn, inputs, send), daemon=True)
    child.start()
    send.close()
    try:
        if not recv.poll(timeout_s):
            error: str | None = f"timed out after {timeout_s:g} s (batch of {n})"
            values = None
        else:
            try:
                values, error = recv.recv()
            except EOFError:
                values, error = None, f"the worker process died (exit code {child.exitcode})"
    finally:
        _stop(child)
        recv.close()
    if values is None:
        return FunctionScores([0.0] * n, [error] * n)
    return FunctionScores(values, [None] * n)


def _stop(child: Any) -> None:
    if child.is_alive():
        child.kill()
    child.join()
