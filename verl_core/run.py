"""The run context handed to every stage: where the run's artifacts live and where it is tracked.

Small, serialisable (a Prefect task parameter), no tensors: stages rebuild the store and the tracker
from it. ``start_run`` creates or resumes a run: takes the run's lease (one live process per run id, see
:mod:`verl_core.store.lease`), writes ``run.json`` and creates/resumes the MLflow run; ``end_run``
releases the lease.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from verl_core.config import VerlFlowConfig, flatten_config
from verl_core.store import ArtifactStore
from verl_core.store.lease import acquire_run_lease, release_run_lease
from verl_core.tracking import MlflowTracker, NullTracker, Tracker, default_tracking_uri


class RunContext(BaseModel):
    """Identity and locations of one run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    store_url: str
    store_max_attempts: int = 10
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    config_hash: str = ""

    def store(self) -> ArtifactStore:
        return ArtifactStore(self.store_url, max_attempts=self.store_max_attempts)

    def tracker(self) -> Tracker:
        if self.tracking_uri is None or self.mlflow_run_id is None:
            return NullTracker()
        return MlflowTracker(self.tracking_uri, self.mlflow_run_id)


def end_run(ctx: RunContext) -> None:
    """Release the run's lease (taken by :func:`start_run`)."""
    release_run_lease(ctx.store_url, ctx.run_id)


def default_run_id(cfg: VerlFlowConfig) -> str:
    """``{experiment_name}-{config hash[:8]}``: rerunning the same config resumes the same run."""
    return f"{cfg.trainer.experiment_name}-{cfg.config_hash()[:8]}"


def start_run(cfg: VerlFlowConfig, run_id: str | None = None) -> RunContext:
    """Write ``run.json`` (resolved config, hash, code version) and create/resume the MLflow run."""
    run_id = run_id or default_run_id(cfg)
    store = ArtifactStore(cfg.store.url, max_attempts=cfg.store.max_attempts)
    acquire_run_lease(store, run_id, cfg.store.lease_ttl_s)  # refuses a run id another process holds
    try:
        return _start(cfg, store, run_id)
    except BaseException:
        release_run_lease(store.url, run_id)
        raise


def _start(cfg: VerlFlowConfig, store: ArtifactStore, run_id: str) -> RunContext:
    config_hash = cfg.config_hash()
    store.write_run_record(run_id, cfg.model_dump(mode="json"), config_hash)
    tracking_uri = mlflow_run_id = None
    if cfg.tracking.enabled:
        tracking_uri = cfg.tracking.uri or default_tracking_uri(store.url)
        tracker = MlflowTracker.start(
            tracking_uri,
            experiment=cfg.trainer.project_name,
            run_id=run_id,
            params=flatten_config(cfg),
            store_url=store.url,
        )
        tracker.set_tags({"verl_flow.config_hash": config_hash, "verl_flow.store": store.url})
        mlflow_run_id = tracker.run_id
    return RunContext(
        run_id=run_id,
        store_url=store.url,
        store_max_attempts=cfg.store.max_attempts,
        tracking_uri=tracking_uri,
        mlflow_run_id=mlflow_run_id,
        config_hash=config_hash,
    )
