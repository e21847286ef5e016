"""Run a stage flow as a deployment on another work pool and wait for it (``execution.mode=deployments``).

Every stage flow takes the parameters ``ctx`` (the run context) and ``config`` (the resolved config),
plus its own; ``remote_*`` start one and return what its local counterpart returns, read from the
shared store."""

from __future__ import annotations

import time
from typing import Any

from stages.floor.artifacts import latest_export
from stages.floor.locations import SFT
from stages.floor.state import RLResult, committed_rl_result
from verl_core.config import VerlFlowConfig
from verl_core.errors import ConfigError, VerlFlowError
from verl_core.run import RunContext


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


def dispatch(ctx: RunContext, config: VerlFlowConfig, field: str, parameters: dict[str, Any]) -> float:
    """Run the deployment named by ``execution.{field}`` with the run context, the config and
    ``parameters``; returns its wall time in seconds."""
    params = {"ctx": ctx.model_dump(mode="json"), "config": config.model_dump(mode="json"), **parameters}
    return run_stage_deployment(
        getattr(config.execution, field),
        params,
        poll_interval_s=config.execution.poll_interval_s,
        field=f"execution.{field}",
    )


def remote_sft(ctx: RunContext, config: VerlFlowConfig, template_pack_uri: str) -> str:
    """SFT as a deployment (``flows.gpu.sft_flow``); returns the sft stage's manifest URI."""
    dispatch(ctx, config, "sft_deployment", {"template_pack_uri": template_pack_uri})
    return ctx.store().manifest_uri(ctx.run_id, SFT)


def remote_rl_loop(
    ctx: RunContext, config: VerlFlowConfig, template_pack_uri: str, sft_uri: str | None
) -> RLResult:
    """The RL loop as a deployment (``flows.rl.rl_loop``); its result rebuilt from the store."""
    dispatch(ctx, config, "rl_deployment", {"template_pack_uri": template_pack_uri, "sft_uri": sft_uri})
    result = committed_rl_result(ctx.store(), ctx.run_id, config, sft_uri)
    if result is None:
        raise StageRunError(f"run {ctx.run_id!r}: the RL flow run completed but committed no checkpoint")
    return result


def remote_export(ctx: RunContext, config: VerlFlowConfig, template_pack_uri: str) -> str:
    """The export of the latest checkpoint as a deployment (``flows.gpu.export_flow``); returns the
    export stage's manifest URI."""
    params = {"template_pack_uri": template_pack_uri, "iteration": None}
    dispatch(ctx, config, "export_deployment", params)
    uri = latest_export(ctx.store(), ctx.run_id)
    if uri is None:
        raise StageRunError(
            f"run {ctx.run_id!r}: the export flow run completed but committed no export of its latest policy"
        )
    return uri
