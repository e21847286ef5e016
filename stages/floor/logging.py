"""Console feedback for stages: the run logger, a rich progress bar for long loops when a terminal is
attached (silent otherwise: stages log their figures every few steps either way), and :func:`timed`
for wall-time accounting."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from verl_core.timing import timed as timed  # re-exported: stages and flows time their phases with it


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
