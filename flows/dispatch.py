"""Run a stage flow as a deployment on another work pool and wait for it (``execution.mode=deployments``)."""

from __future__ import annotations

import time
from typing import Any

from verl_core.errors import ConfigError, VerlFlowError


class StageRunError(VerlFlowError):
    """A dispatched stage flow run did not complete; the message names the deployment and the run."""


def run_stage_deployment(
    deployment: str, parameters: dict[str, Any], *, poll_interval_s: float, field: str
) -> float:
    """Start ``deployment`` (``flow/name``) with ``parameters`` (JSON-ready), wait until it ends, and
    return its wall time in seconds; raise :class:`StageRunError` unless it completed. ``field`` is
    the config field naming the deployment (for the error when it does not exist)."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    t0 = time.perf_counter()
    try:
        run = run_deployment(
            name=deployment, parameters=parameters, timeout=None, poll_interval=poll_interval_s
        )
    except ObjectNotFound:
        raise ConfigError(
            f"{field}: no deployment {deployment!r} on the Prefect server (run `prefect deploy --all`)"
        ) from None
    state = run.state
    if state is None or not state.is_completed():
        what = state.name if state is not None else "without a state"
        detail = f": {state.message}" if state is not None and state.message else ""
        raise StageRunError(f"{deployment}: flow run {run.name!r} ({run.id}) ended {what}{detail}")
    return time.perf_counter() - t0
