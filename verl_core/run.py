"""The run context handed to every stage: where the run's artifacts live and where it is tracked.

Small, serialisable (a Prefect task parameter), no tensors: stages rebuild the store and the tracker
from it. ``start_run`` creates or resumes a run: ``run.json`` in the store and the MLflow run.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from verl_core.config import VerlFlowConfig, flatten_config
from verl_core.store import ArtifactStore
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


def default_run_id(cfg: VerlFlowConfig) -> str:
    """``{experiment_name}-{config hash[:8]}``: rerunning the same config resumes the same run."""
    return f"{cfg.trainer.experiment_name}-{cfg.config_hash()[:8]}"


def start_run(cfg: VerlFlowConfig, run_id: str | None = None) -> RunContext:
    """Write ``run.json`` (resolved config, hash, code version) and create/resume the MLflow run."""
    run_id = run_id or default_run_id(cfg)
    store = ArtifactStore(cfg.store.url, max_attempts=cfg.store.max_attempts)
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
