"""Run a stage flow as a deployment on another work pool and wait for it (``execution.mode=deployments``).

Every stage flow takes the parameters ``ctx`` (the run context) and ``config`` (the resolved config),
plus its own; ``remote_*`` start one and return what its local counterpart returns, read from the
shared store. The dispatched flow run's side, its heartbeat and the fence that stops a run given up,
is the store's lease protocol (:func:`verl_core.store.lease.stage_heartbeat`, :mod:`flows.heartbeat`)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from stages.floor.artifacts import latest_export
from stages.floor.lineage import RLResult, committed_rl_result
from stages.floor.locations import SFT
from stages.floor.logging import stage_logger
from verl_core.config import ExecutionConfig, VerlFlowConfig
from verl_core.errors import ConfigError, VerlFlowError
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore
from verl_core.store.lease import STAGE_LEASE, fence_stage_holder, read_lease


class StageRunError(VerlFlowError):
    """A dispatched stage flow run did not complete; the message names the deployment and the run."""


class Verdict(enum.Enum):
    WAIT = "wait"
    COMPLETED = "completed"
    LOST = "lost"  # claimed by a worker, then silent: worker and flow-run process gone (preempted)
    CRASHED = "crashed"  # Prefect saw its process die (the worker lived): dispatched again too
    FAILED = "failed"  # failed or cancelled: an error of its own, not dispatched again
    UNCLAIMED = "unclaimed"  # no worker of its pool online for execution.redispatch_timeout_s


UNKNOWN = object()  # a lease that could not be read (the store did not answer)
_CLAIMED = {"PENDING", "RUNNING"}  # a worker took the flow run
_ENDED_BADLY = {"FAILED", "CANCELLED", "CANCELLING"}


@dataclass
class Watch:
    """What the dispatcher has seen of one dispatched flow run, on its own monotonic clock (no
    comparison of clocks across hosts). Fed one observation per poll by :meth:`observe`."""

    flow_run_id: str
    lost_after_s: float
    start_timeout_s: float
    unclaimed_after_s: float
    claimed_at: float | None = None  # first seen PENDING or RUNNING
    beat_at: float | None = None  # last time its stage lease moved (or could not be read)
    beat_version: str | None = None
    no_worker_since: float | None = None

    def observe(self, now: float, state: str | None, lease: Any, workers_online: bool | None) -> Verdict:
        """``state``: the flow run's state type (None: the API did not answer); ``lease``: the stage
        lease as ``(holder, version)``, None when nobody holds it, or :data:`UNKNOWN`;
        ``workers_online``: whether its pool has a worker online (None: not asked).

        Lost when, claimed, its lease has not moved for ``lost_after_s`` (or, never renewed, it has not
        started within ``start_timeout_s`` of the claim). Unclaimed when it has waited with no worker
        online for ``unclaimed_after_s``. An unreadable lease counts as a beat: a store outage says
        nothing about the holder."""
        if state == "COMPLETED":
            return Verdict.COMPLETED
        if state == "CRASHED":
            return Verdict.CRASHED
        if state in _ENDED_BADLY:
            return Verdict.FAILED
        if state in _CLAIMED and self.claimed_at is None:
            self.claimed_at = now
        if lease is UNKNOWN:
            self.beat_at = now
        elif lease is not None and lease[0] == self.flow_run_id and lease[1] != self.beat_version:
            self.beat_at, self.beat_version = now, lease[1]
        if state == "SCHEDULED":
            if workers_online is False:
                self.no_worker_since = self.no_worker_since or now
                if now - self.no_worker_since > self.unclaimed_after_s:
                    return Verdict.UNCLAIMED
            elif workers_online:
                self.no_worker_since = None
        if self.claimed_at is not None and state != "PAUSED":
            if self.beat_at is None:
                if now - self.claimed_at > self.start_timeout_s:
                    return Verdict.LOST
            elif now - self.beat_at > self.lost_after_s:
                return Verdict.LOST
        return Verdict.WAIT


def run_stage_deployment(
    deployment: str,
    parameters: dict[str, Any],
    *,
    execution: ExecutionConfig,
    field: str,
    store: ArtifactStore,
    run_id: str,
) -> float:
    """Start ``deployment`` (``flow/name``) with ``parameters`` (JSON-ready), wait until it ends, and
    return its wall time in seconds; raise :class:`StageRunError` unless it completed. ``field`` is
    the config field naming the deployment (for the error when it does not exist).

    A flow run that is lost (see :class:`Watch`) or crashed is marked Crashed and fenced off
    (:func:`verl_core.store.lease.fence_stage_holder`; Prefect lets a Crashed run that was only slow go
    on to Running, the fence stops it), and the deployment is run again
    (``execution.redispatch_retries`` times): the new flow run resumes from the last committed
    checkpoint wherever a worker picks it up."""
    t0 = time.perf_counter()
    log = stage_logger(__name__)
    retries = execution.redispatch_retries
    for attempt in range(retries + 1):
        flow_run = _start(deployment, parameters, field)
        verdict, why = _supervise(flow_run.id, deployment, execution, store, run_id)
        if verdict is Verdict.COMPLETED:
            return time.perf_counter() - t0
        what = f"{deployment}: flow run {flow_run.name!r} ({flow_run.id}) {why}"
        if verdict in (Verdict.LOST, Verdict.CRASHED) and attempt < retries:
            log.warning("%s; dispatching it again (%d of %d)", what, attempt + 1, retries)
            continue
        if verdict in (Verdict.LOST, Verdict.CRASHED):
            what += f"; dispatched {retries + 1} times (execution.redispatch_retries={retries}): giving up"
        raise StageRunError(what)
    raise AssertionError("unreachable")


def _start(deployment: str, parameters: dict[str, Any], field: str) -> Any:
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    try:
        return run_deployment(name=deployment, parameters=parameters, timeout=0)
    except ObjectNotFound:
        raise ConfigError(
            f"{field}: no deployment {deployment!r} on the Prefect server (run `prefect deploy --all`)"
        ) from None


def _supervise(
    flow_run_id: Any, deployment: str, execution: ExecutionConfig, store: ArtifactStore, run_id: str
) -> tuple[Verdict, str]:
    """Poll the flow run until :class:`Watch` gives a verdict other than WAIT; returns it and why,
    after marking a lost run Crashed, cancelling an unclaimed one and revoking a lost or crashed run's
    stage lease."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelled, Crashed

    watch = Watch(
        str(flow_run_id), execution.lost_after_s, execution.start_timeout_s, execution.redispatch_timeout_s
    )
    api_down_since: float | None = None
    echoed: Any = None  # the timestamp of the last progress line echoed
    with get_client(sync_client=True) as client:
        while True:
            now = time.monotonic()
            state, pool, message = None, None, ""
            try:
                fr = client.read_flow_run(flow_run_id)
                pool = fr.work_pool_name
                if fr.state is not None:
                    state, message = fr.state.type.value, fr.state.message or ""
                api_down_since = None
            except Exception as e:  # the server restarting, or gone: the stage may well go on meanwhile
                api_down_since = api_down_since or now
                if now - api_down_since > execution.api_outage_s:
                    raise StageRunError(
                        f"{deployment}: the Prefect API {PREFECT_API_URL.value()} has not answered for "
                        f"{now - api_down_since:.0f} s (execution.api_outage_s) while waiting on flow run "
                        f"{flow_run_id} ({type(e).__name__}); the stage's committed work is kept: rerun "
                        "the pipeline to resume"
                    ) from None
            if state == "RUNNING":
                echoed = echo_progress(client, flow_run_id, echoed)
            lease = _lease(store, run_id) if watch.claimed_at is not None or state in _CLAIMED else None
            online = _workers_online(client, pool) if state == "SCHEDULED" and pool else None
            verdict = watch.observe(now, state, lease, online)
            if verdict is Verdict.WAIT or (verdict is Verdict.LOST and state is None):
                time.sleep(execution.poll_interval_s)  # lost, but only the API can mark and redispatch it
                continue
            if verdict is Verdict.COMPLETED:
                return verdict, "completed"
            if verdict is Verdict.FAILED:
                return verdict, f"ended {state.title() if state else ''}{': ' + message if message else ''}"
            if verdict is Verdict.UNCLAIMED:
                why = (
                    f"was not picked up: no worker of work pool {pool!r} has been online for "
                    f"{execution.redispatch_timeout_s:g} s (execution.redispatch_timeout_s); start one "
                    f"(`prefect worker start --pool {pool}`) and rerun the pipeline to resume"
                )
                client.set_flow_run_state(flow_run_id, Cancelled(message=why), force=True)
                return verdict, why
            if verdict is Verdict.LOST:
                why = (
                    f"lost: no heartbeat for {execution.lost_after_s:g} s (execution.lost_after_s), "
                    "its worker presumably preempted"
                )
                client.set_flow_run_state(flow_run_id, Crashed(message=why), force=True)
            else:
                why = f"crashed{': ' + message if message else ''}"
            fence_stage_holder(store, run_id, str(flow_run_id))
            return verdict, why


def echo_progress(client: Any, flow_run_id: Any, after: Any) -> Any:
    """Print the progress lines (:data:`flows.progress.PROGRESS`) the dispatched flow run logged
    after the timestamp ``after`` on this process's console (``verl-flow run`` in deployments mode);
    not to the API: the flow run copies them into the pipeline's log itself. Returns the timestamp
    of the last line read."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
    from prefect.client.schemas.sorting import LogSort

    from flows.progress import PROGRESS

    since = LogFilterTimestamp(after_=after) if after is not None else None
    try:
        logs = client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]), timestamp=since),
            limit=200,
            sort=LogSort.TIMESTAMP_ASC,
        )
    except Exception:  # the API busy or restarting: the next poll reads them
        return after
    log = stage_logger(__name__)
    for line in logs:
        if line.timestamp != after and PROGRESS.match(line.message):
            log.info(line.message, extra={"send_to_api": False})
    return logs[-1].timestamp if logs else after


def _lease(store: ArtifactStore, run_id: str) -> Any:
    """The stage lease as ``(holder, version)``, None, or :data:`UNKNOWN` when the store fails."""
    try:
        found = read_lease(store, run_id, STAGE_LEASE)
    except Exception:
        return UNKNOWN
    if found is None:
        return None
    record, version = found
    return (record.holder if record is not None else None, version)


def _workers_online(client: Any, pool: str) -> bool | None:
    try:
        workers = client.read_workers_for_work_pool(pool)
    except Exception:
        return None
    return any(str(getattr(w.status, "value", w.status)).upper() == "ONLINE" for w in workers)


def dispatch(ctx: RunContext, config: VerlFlowConfig, field: str, parameters: dict[str, Any]) -> float:
    """Run the deployment named by ``execution.{field}`` with the run context, the config and
    ``parameters``; returns its wall time in seconds."""
    params = {"ctx": ctx.model_dump(mode="json"), "config": config.model_dump(mode="json"), **parameters}
    return run_stage_deployment(
        getattr(config.execution, field),
        params,
        execution=config.execution,
        field=f"execution.{field}",
        store=ctx.store(),
        run_id=ctx.run_id,
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
