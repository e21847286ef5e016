"""Progress of the stage flows (SFT, the RL loop) in the pipeline flow run's own logs.

``prefect deployment run --watch`` and the UI's page of a pipeline run follow that flow run's logs
only; SFT and the RL loop are flow runs of their own (subflows in local mode, deployments' runs in
deployments mode), so for the hours they run the pipeline's log stood silent. Within a stage flow,
:func:`to_pipeline` copies its progress lines (:data:`PROGRESS`: ``sft: step 40/126 ...``,
``rl: iteration 3/10: reward``, ``rl: iteration 3/10 done ...``) into the logs of the flow run that
started it, through Prefect's API log handler only (a local run's console shows each line once);
in deployments mode the pipeline process also prints them on its console as it polls the stage
(:func:`flows.dispatch.echo_progress`).

The RL loop's per-stage lines (:func:`stage_line`) come at most every :data:`STAGE_LINE_EVERY_S`
seconds per run: on a real run (minutes per stage) every stage, on the quickstart (seconds per
iteration) only the per-iteration lines.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stages.floor.logging import stage_logger

PROGRESS = re.compile(r"^(sft: step \d+/\d+|rl: iteration \d+/\d+)")
STAGE_LINE_EVERY_S = 30.0
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # what get_run_logger logs to

_last_stage_line: dict[str, float] = {}  # run id → monotonic time of its last stage line


def stage_line(run_id: str, message: str, *, now: float | None = None) -> bool:
    """Log ``message`` (``rl: iteration 3/10: reward``) at INFO unless run ``run_id`` logged one less
    than :data:`STAGE_LINE_EVERY_S` ago; returns whether it did."""
    now = time.monotonic() if now is None else now
    last = _last_stage_line.get(run_id)
    if last is not None and now - last < STAGE_LINE_EVERY_S:
        return False
    _last_stage_line[run_id] = now
    stage_logger(__name__).info(message)
    return True


class _ToPipeline(logging.Handler):
    """Sends a copy of each progress record to the API as a log of flow run ``flow_run_id``."""

    def __init__(self, flow_run_id: str) -> None:
        from prefect.logging.handlers import APILogHandler

        super().__init__()
        self.flow_run_id = flow_run_id
        self.api = APILogHandler()

    def emit(self, record: logging.LogRecord) -> None:
        if not PROGRESS.match(record.getMessage()):
            return
        fields: dict[str, Any] = {**record.__dict__, "flow_run_id": self.flow_run_id, "task_run_id": None}
        self.api.handle(logging.makeLogRecord(fields))


def _parent_flow_run_id() -> str | None:
    """The flow run that started this one (a subflow's parent, or the flow run that called
    ``run_deployment``); None outside a flow run or for a flow run started on its own."""
    from prefect.runtime import flow_run

    try:
        return flow_run.get_parent_flow_run_id()  # type: ignore[no-any-return]
    except Exception:  # the API unreachable: the progress lines stay in this flow run's log
        return None


@contextmanager
def to_pipeline() -> Iterator[None]:
    """Within a stage flow run: copy its progress lines into the logs of the flow run that started it."""
    parent = _parent_flow_run_id()
    if parent is None:
        yield
        return
    handler = _ToPipeline(parent)
    loggers = [logging.getLogger(name) for name in RUN_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
