"""The console and the log file of ``verl-flow run``: one failure story.

Every log record of the run (Prefect's task and flow states, retries, tracebacks, the temporary
server's start and stop, the stages' own lines) goes to a log file (:func:`log_path`): ``logs/`` at
the root of a local store, else ``./logs``. The console keeps the progress lines but not Prefect's lines
about a failed task or flow nor any traceback (unless ``verbose``); on failure the CLI prints one
line naming the stage (and iteration), what failed and where the log file is. With a Prefect server
the run's records also reach its UI (Prefect's API log handler is left alone).

Which stage failed: Prefect logs the exception a task run failed with (``exc_info``) while the task
run's context is current, so a handler remembers, for each exception, the innermost task (or flow)
run that failed with it and that task's ``iteration`` parameter, if it has one.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

from launcher.prefect_api import api_failure
from verl_core.config import VerlFlowConfig
from verl_core.errors import VerlFlowError
from verl_core.runtime.run import default_run_id
from verl_core.store import ArtifactStore, normalize_url

# the messages of Prefect's engine about a failed (or retried) task or flow run that carry no
# traceback: state changes and retry notices
_FAILURE_LINES = ("Finished in state Failed", "Finished in state Crashed", "Task run failed with")


class FailedRun(NamedTuple):
    """The innermost Prefect run that failed with an exception: a task (a stage) or a flow."""

    kind: str  # "stage" (a task run) or "flow"
    name: str  # the task's or flow's name, as in the Prefect UI
    iteration: int | None  # the task's ``iteration`` parameter (RL stages, checkpoints)

    def describe(self) -> str:
        """``stage reward, iteration 1``, ``flow rl-loop``."""
        it = "" if self.iteration is None else f", iteration {self.iteration}"
        return f"{self.kind} {self.name}{it}"


class _HideFailures(logging.Filter):
    """On the console: no traceback and no line of Prefect's about a failed task or flow."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.exc_text:
            return False
        if record.levelno >= logging.ERROR and record.name.startswith("prefect"):
            return False
        return not record.getMessage().startswith(_FAILURE_LINES)


class _FailedRuns(logging.Handler):
    """Remembers which Prefect run each logged exception failed; the first (innermost) one wins."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.seen: list[tuple[BaseException, FailedRun]] = []  # the exceptions kept alive: no id reuse

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or any(e is exc for e, _ in self.seen):
            return
        from prefect.context import FlowRunContext, TaskRunContext

        task_ctx = TaskRunContext.get()
        if task_ctx is not None:
            iteration = task_ctx.parameters.get("iteration")
            it = iteration if isinstance(iteration, int) else None
            self.seen.append((exc, FailedRun("stage", task_ctx.task.name, it)))
            return
        flow_ctx = FlowRunContext.get()
        if flow_ctx is not None and flow_ctx.flow is not None:
            self.seen.append((exc, FailedRun("flow", flow_ctx.flow.name, None)))

    def find(self, exc: BaseException) -> FailedRun | None:
        return next((where for e, where in self.seen if e is exc), None)


class RunLog:
    """The log file of one ``verl-flow run`` and the console filter; ``close()`` detaches both."""

    def __init__(self, path: Path, verbose: bool) -> None:
        from prefect.logging.configuration import ensure_logging_setup
        from prefect.logging.formatters import PrefectFormatter

        ensure_logging_setup()  # Prefect's handlers first: it drops its console handler if it finds ours

        self.path, self.verbose = path, verbose
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = logging.FileHandler(path, encoding="utf-8")
        self._file.setFormatter(
            PrefectFormatter(
                format="%(asctime)s | %(levelname)-7s | %(name)s - %(message)s",
                flow_run_fmt="%(asctime)s | %(levelname)-7s | Flow run %(flow_run_name)r - %(message)s",
                task_run_fmt="%(asctime)s | %(levelname)-7s | Task run %(task_run_name)r - %(message)s",
            )
        )
        self._failed = _FailedRuns()
        self._filter = _HideFailures()
        root = logging.getLogger()
        root.addHandler(self._file)
        root.addHandler(self._failed)
        self._console = [] if verbose else _console_handlers()
        for handler in self._console:
            handler.addFilter(self._filter)

    def failure_line(self, exc: BaseException) -> str:
        """One line: where (stage and iteration, or flow), what failed, where the full log is. Also
        writes the exception's traceback to the log file when Prefect did not log it already."""
        where = self._failed.find(exc)
        if where is None:
            record = logging.LogRecord("verl_flow", logging.ERROR, __file__, 0, "run failed", None, None)
            record.exc_info = (type(exc), exc, exc.__traceback__)
            self._file.handle(record)
            if self.verbose:
                import traceback

                traceback.print_exception(exc, file=sys.stderr)
        what = api_failure(exc) or (
            str(exc) if isinstance(exc, VerlFlowError) else f"{type(exc).__name__}: {exc}"
        )
        prefix = f"{where.describe()}: " if where else ""
        return f"{prefix}{' '.join(what.split())} (full log: {self.path})"

    def close(self) -> None:
        root = logging.getLogger()
        root.removeHandler(self._failed)
        root.removeHandler(self._file)
        self._file.close()
        for handler in self._console:
            handler.removeFilter(self._filter)


def _console_handlers() -> list[logging.Handler]:
    """The handlers of Prefect's logging config that write to the terminal: its console handler (on
    the root logger, shared with uvicorn and fastapi) and the one of ``prefect._internal``."""
    loggers = [logging.getLogger()] + [
        lg
        for name, lg in logging.Logger.manager.loggerDict.items()
        if isinstance(lg, logging.Logger) and name.split(".")[0] in ("prefect", "uvicorn", "fastapi")
    ]
    found: dict[int, logging.Handler] = {}
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                found[id(h)] = h
    return list(found.values())


def log_path(cfg: VerlFlowConfig, run_id: str | None) -> Path:
    """Where ``verl-flow run`` writes its full log, one file per process:
    ``logs/{run_id}/{time}-{pid}.log`` at the root of a local store (beside ``runs/`` and
    ``mlflow.db``; not inside the run's directory, which holds only its record and committed
    artifacts), else under the working directory. Without ``--run-id``, a config with data snapshots
    learns its run id only inside the flow: then ``logs/{time}-{pid}.log``."""
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    own = default_run_id(cfg.trainer.experiment_name, cfg.config_hash())
    rid = run_id or (own if cfg.data.snapshot_prefix is None else None)
    local = normalize_url(cfg.store.url).startswith("file://")
    base = Path(ArtifactStore(cfg.store.url).root) if local else Path.cwd()
    return base / "logs" / rid / name if rid else base / "logs" / name
