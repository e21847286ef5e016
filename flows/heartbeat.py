"""The heartbeat of a stage flow (SFT, the RL loop, the export) that the pipeline dispatched to a worker
(``execution.mode=deployments``, :mod:`flows.dispatch`): the run's stage lease held for the flow's
length, with the fence that stops a flow run the pipeline gave up, is the store's lease protocol
(:func:`verl_core.store.lease.stage_heartbeat`); this module only says which flow run holds it and
when there is none to hold."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from stages.floor.logging import stage_logger
from verl_core.config import VerlFlowConfig
from verl_core.runtime.run import RunContext
from verl_core.store.lease import stage_heartbeat


@contextmanager
def heartbeat(ctx: RunContext, config: VerlFlowConfig) -> Iterator[None]:
    """In a stage flow run dispatched by the pipeline: hold the run's stage lease (holder: this flow
    run's id), renewed every ``execution.lost_after_s / 3``, for the whole flow; revoked, the flow
    stops. Elsewhere (local mode, a flow called directly): nothing."""
    from prefect.runtime import flow_run

    run_id = flow_run.get_id()
    if config.execution.mode != "deployments" or not run_id:
        yield
        return

    def lost() -> None:
        stage_logger(__name__).error("flow run %s: its stage lease was revoked; stopping", run_id)

    with stage_heartbeat(ctx.store(), ctx.run_id, str(run_id), config.execution.lost_after_s, lost):
        yield
