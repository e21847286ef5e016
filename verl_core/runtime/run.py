"""The run context handed to every stage: where the run's artifacts live and where it is tracked.

Small, serialisable (a Prefect task parameter), no tensors: stages rebuild the store and the tracker
from it. With ``tracking.backends`` naming several backends the context carries each one's run id and
:meth:`RunContext.tracker` logs to all of them. A run is started from its config above verl_core
(:func:`flows.runs.start_run`: the run's lease, ``run.json``, the tracker runs); :func:`end_run`
releases the lease.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from verl_core.config.run import StoreConfig
from verl_core.runtime.tracking import FanOutTracker, MlflowTracker, NullTracker, Tracker
from verl_core.runtime.wandb_tracking import WandbTracker
from verl_core.store import ArtifactStore
from verl_core.store.lease import release_run_lease


class RunContext(BaseModel):
    """Identity and locations of one run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    store_url: str
    store_max_attempts: int = 10
    store_outage_budget_s: float = StoreConfig().outage_budget_s
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    wandb_run_id: str | None = None  # None: no W&B tracking
    wandb_project: str = ""
    wandb_entity: str | None = None
    config_hash: str = ""

    def store(self) -> ArtifactStore:
        return ArtifactStore(
            self.store_url,
            max_attempts=self.store_max_attempts,
            outage_budget_s=self.store_outage_budget_s,
        )

    def tracker(self) -> Tracker:
        """The run's tracker: MLflow, W&B, both (:class:`FanOutTracker`) or none."""
        trackers: list[Tracker] = []
        if self.tracking_uri is not None and self.mlflow_run_id is not None:
            trackers.append(MlflowTracker(self.tracking_uri, self.mlflow_run_id))
        if self.wandb_run_id is not None:
            trackers.append(
                WandbTracker(self.wandb_run_id, self.wandb_project, self.run_id, self.wandb_entity)
            )
        if not trackers:
            return NullTracker()
        return trackers[0] if len(trackers) == 1 else FanOutTracker(trackers)


def end_run(ctx: RunContext) -> None:
    """Release the run's lease (taken by :func:`flows.runs.start_run`)."""
    release_run_lease(ctx.store_url, ctx.run_id)


def default_run_id(experiment_name: str, config_hash: str) -> str:
    """``{experiment_name}-{config hash[:8]}``: rerunning the same config resumes the same run."""
    return f"{experiment_name}-{config_hash[:8]}"
