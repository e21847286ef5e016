"""Console feedback for stages: the run logger, a rich progress bar for long loops when a terminal is
attached (silent otherwise: stages log their figures every few steps either way), :func:`timed`
for wall-time accounting and :func:`watched`, the hang watchdog around a stage."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from verl_core.runtime.run import RunContext, end_run
from verl_core.runtime.watchdog import Heartbeat
from verl_core.timing import timed as timed  # re-exported: stages and flows time their phases with it

STALL_GRACE_S = 60.0  # after failing a stalled stage, how long it may take to unwind before the process ends
# The summary key where a stage run for one generation batch of a dynamically sampled iteration puts
# the metrics it would log at the iteration's step: flows.sampling logs the batches' metrics once,
# combined, so each metric has one value per step.
DEFERRED_METRICS = "deferred_metrics"


def stage_logger(name: str = "verl_flow") -> Any:
    """Prefect's run logger inside a flow/task run (shown in the UI), a standard logger outside one."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(name)


class Advance(Protocol):
    def __call__(self, steps: int = 1, *, status: str = "") -> None: ...


@contextmanager
def progress(description: str, total: int, completed: int = 0) -> Iterator[Advance]:
    """``with progress("sft", 126, completed=40) as advance: ... advance(1, status="loss=1.2")``."""
    if not sys.stderr.isatty():

        def noop(steps: int = 1, *, status: str = "") -> None:
            pass

        yield noop
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
    )  # fmt: skip
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(description, total=total, completed=completed, status="")

        def advance(steps: int = 1, *, status: str = "") -> None:
            bar.update(task, advance=steps, status=status)

        yield advance


@contextmanager
def watched(
    ctx: RunContext, stage: str, stall_timeout_s: float, iteration: int | None = None
) -> Iterator[None]:
    """``with watched(ctx, "rollout", cfg.execution.stall_timeout_s, iteration=i): rollout(...)``: the
    stage fails with :class:`~verl_core.runtime.watchdog.StallError` after ``stall_timeout_s`` seconds without
    a :func:`~verl_core.runtime.watchdog.beat` (training steps, generation batches and scorers beat). Wrap the
    task *call* (the flow's side), so the error leaves the task as a crash, never as a retried failure.
    Last resort (the stage does not unwind within :data:`STALL_GRACE_S`): the tracking run is marked
    FAILED and the run's lease released before the process exits."""

    def abort() -> None:
        ctx.tracker().end("FAILED")
        end_run(ctx)

    with Heartbeat(
        stage, stall_timeout_s, iteration=iteration, grace_s=STALL_GRACE_S, log=stage_logger(), on_abort=abort
    ):
        yield
