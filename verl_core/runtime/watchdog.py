"""Hang watchdog: a stage that makes no progress for ``timeout_s`` seconds is failed, never left hanging.

    with Heartbeat("rollout", timeout_s=1800, iteration=3):   # the stage body
        ...
        beat(sequences=64, tokens=8192)                       # anywhere below it, e.g. per batch

:func:`beat` records progress on the innermost active :class:`Heartbeat` (a no-op when none is active),
so kernels deep in the call stack (an optimizer step, a generation batch) report progress without
being handed anything. A monitor thread checks the time since the last beat; past ``timeout_s`` it
fails the stage in the thread that entered the heartbeat:

1. the main thread: a ``SIGUSR2`` sent to it interrupts a blocking call (``time.sleep``, a socket
   read) and its handler raises :class:`StageStalled`;
2. another thread: ``PyThreadState_SetAsyncExc`` raises :class:`StageStalled` at the thread's next
   Python bytecode (a thread blocked inside C code is not reached);
3. last resort: a stage that has not unwound ``grace_s`` seconds later (stuck in C, or swallowing the
   exception) is logged, ``on_abort`` runs (mark the tracking run failed, release the lease) and the
   process ends with exit code :data:`STALL_EXIT_CODE` (``os._exit``: nothing hangs forever).

:class:`StageStalled` derives from ``BaseException`` so that ``except Exception`` handlers and task
retries do not swallow it on its way up; leaving the ``with`` block turns it into :class:`StallError`
(a :class:`~verl_core.errors.VerlFlowError`) whose message names the stage, the iteration and the last
progress (what and when). Stuck collectives are bounded separately: the process group's timeout
(:func:`verl_core.training.distributed.init_distributed`) is derived from the same setting.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime
from types import FrameType, TracebackType
from typing import Any

from verl_core.errors import VerlFlowError

STALL_EXIT_CODE = 3  # the process exit code when a stalled stage did not unwind within the grace period
INTERRUPT_SIGNAL = signal.SIGUSR2


class StallError(VerlFlowError):
    """A stage made no progress for its stall timeout; the message names the stage, the iteration
    and the last progress."""


class StageStalled(BaseException):
    """Raised inside a stalled stage to unwind it (a BaseException: ``except Exception`` lets it pass)."""


_ACTIVE: list[Heartbeat] = []  # entered heartbeats, innermost last
_ACTIVE_LOCK = threading.Lock()
_previous_handler: Any = None
_handler_installed = False


def beat(**progress: Any) -> None:
    """Record progress (``steps=12, tokens=4096``) on the innermost active heartbeat entered by the
    calling thread (two stages running side by side each keep their own), else on the innermost one
    (a stage's helper threads); no-op without any."""
    active, me = list(_ACTIVE), threading.get_ident()
    if active:
        next((h for h in reversed(active) if h._thread_id == me), active[-1]).beat(**progress)


class Heartbeat:
    """Fails the stage run inside ``with Heartbeat(...)`` when no :meth:`beat` came for ``timeout_s``
    seconds (``timeout_s <= 0``: disabled, no thread). ``log``: where the stall is reported;
    ``on_abort``: called before the process is terminated (last resort); ``poll_s``: how often the
    monitor looks (default ``min(1, timeout_s / 4)``); ``exit_fn``: ``os._exit`` (tests replace it)."""

    def __init__(
        self,
        stage: str,
        timeout_s: float,
        *,
        iteration: int | None = None,
        grace_s: float = 60.0,
        log: Any = None,
        on_abort: Callable[[], None] | None = None,
        poll_s: float | None = None,
        exit_fn: Callable[[int], Any] = os._exit,
    ) -> None:
        self.stage, self.iteration, self.timeout_s, self.grace_s = stage, iteration, timeout_s, grace_s
        self.log = log or logging.getLogger(__name__)
        self.on_abort, self.exit_fn = on_abort, exit_fn
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(timeout_s, 0.0) / 4)
        self.message: str | None = None  # set when the heartbeat trips
        # (monotonic time, wall time, progress) of the last beat; one tuple, replaced atomically
        self._last: tuple[float, float, dict[str, Any]] = (time.monotonic(), time.time(), {})
        self._lock = threading.Lock()  # orders the monitor's interrupt against the stage's exit
        self._closed = False
        self._exited = threading.Event()
        self._raise_pending = False  # the main-thread signal handler raises once
        self._thread_id = 0
        self._monitor: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def beat(self, **progress: Any) -> None:
        """Progress was made; ``progress`` (steps, tokens, ...) is what the stall error reports."""
        self._last = (time.monotonic(), time.time(), progress)

    def last_progress(self) -> str:
        """``"step=12 tokens=4096 at 14:03:07 (95 s ago)"``, or since when the stage ran without any."""
        t, wall, progress = self._last
        when = f"at {datetime.fromtimestamp(wall):%H:%M:%S} ({time.monotonic() - t:.0f} s ago)"
        if not progress:
            return f"none since the stage started {when}"
        return " ".join(f"{k}={v}" for k, v in progress.items()) + f" {when}"

    def __enter__(self) -> Heartbeat:
        self._thread_id = threading.get_ident()
        self._last = (time.monotonic(), time.time(), {})
        with _ACTIVE_LOCK:
            _ACTIVE.append(self)
        if self.enabled:
            if threading.current_thread() is threading.main_thread():
                _install_signal_handler()
            self._monitor = threading.Thread(target=self._watch, name=f"watchdog-{self.stage}", daemon=True)
            self._monitor.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._lock:  # after this, the monitor interrupts nothing more
            self._closed = True
            self._raise_pending = False
        if self.message is not None and threading.current_thread() is not threading.main_thread():
            _set_async_exc(self._thread_id, None)  # drop an interrupt not delivered yet
        self._exited.set()
        with _ACTIVE_LOCK:
            _ACTIVE.remove(self)
        if self._monitor is not None:
            self._monitor.join(timeout=max(1.0, 2 * self.poll_s))
        if self.message is not None:
            raise StallError(self.message) from exc

    def _watch(self) -> None:
        while not self._exited.wait(self.poll_s):
            if time.monotonic() - self._last[0] > self.timeout_s:
                self._trip()
                return

    def _trip(self) -> None:
        where = self.stage if self.iteration is None else f"{self.stage} (iteration {self.iteration})"
        with self._lock:
            if self._closed:  # the stage ended meanwhile
                return
            self.message = (
                f"{where}: no progress for {self.timeout_s:g} s (execution.stall_timeout_s); "
                f"last progress: {self.last_progress()}"
            )
            if self._thread_id == threading.main_thread().ident:
                self._raise_pending = True
                signal.pthread_kill(self._thread_id, INTERRUPT_SIGNAL)
            else:
                _set_async_exc(self._thread_id, StageStalled)
        self.log.error("%s: failing the stage", self.message)
        if self._exited.wait(self.grace_s):
            return
        self.log.error(
            "%s: the stage did not unwind within %g s; terminating the process (exit code %d)",
            where, self.grace_s, STALL_EXIT_CODE,
        )  # fmt: skip
        if self.on_abort is not None:
            try:
                self.on_abort()
            except Exception:  # the process ends either way
                self.log.exception("%s: on_abort failed", where)
        for handler in logging.getLogger().handlers + getattr(self.log, "handlers", []):
            handler.flush()
        self.exit_fn(STALL_EXIT_CODE)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode (None: cancel a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


def _install_signal_handler() -> None:
    """Once per process, from the main thread: :data:`INTERRUPT_SIGNAL` raises :class:`StageStalled`
    in the main thread when a heartbeat asked for it, else goes to the handler installed before."""
    global _previous_handler, _handler_installed
    if _handler_installed:
        return
    _previous_handler = signal.signal(INTERRUPT_SIGNAL, _on_signal)
    _handler_installed = True


def _on_signal(signum: int, frame: FrameType | None) -> None:
    for hb in list(_ACTIVE):
        if hb._raise_pending:
            hb._raise_pending = False
            raise StageStalled(hb.message)
    if callable(_previous_handler):
        _previous_handler(signum, frame)
