"""The run context handed to every stage: where the run's artifacts live and where it is tracked.

Small, serialisable (a Prefect task parameter), no tensors: stages rebuild the store and the tracker
from it. ``start_run`` creates or resumes a run: takes the run's lease (one live process per run id, see
:mod:`verl_core.store.lease`), writes ``run.json`` and creates/resumes the MLflow run; ``end_run``
releases the lease. With ``tracking.backends`` naming several backends the context carries each
one's run id and :meth:`RunContext.tracker` logs to all of them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from verl_core.config import VerlFlowConfig, config_dump, flatten_config
from verl_core.config.run import StoreConfig
from verl_core.runtime.tracking import (
    FanOutTracker,
    MlflowTracker,
    NullTracker,
    Tracker,
    default_tracking_uri,
    experiment_name,
)
from verl_core.runtime.wandb_tracking import WandbTracker, require_wandb, wandb_run_id
from verl_core.store import ArtifactStore
from verl_core.store.lease import acquire_run_lease, release_run_lease


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


def wandb_fields(cfg: VerlFlowConfig, store_url: str, run_id: str) -> dict[str, Any]:
    """The W&B fields of the :class:`RunContext` of ``run_id`` (none without W&B tracking)."""
    t = cfg.tracking
    if not (t.enabled and "wandb" in t.backends):
        return {}
    return {
        "wandb_run_id": wandb_run_id(store_url, run_id),
        "wandb_project": t.wandb_project or cfg.trainer.project_name,
        "wandb_entity": t.wandb_entity,
    }


def end_run(ctx: RunContext) -> None:
    """Release the run's lease (taken by :func:`start_run`)."""
    release_run_lease(ctx.store_url, ctx.run_id)


def default_run_id(cfg: VerlFlowConfig) -> str:
    """``{experiment_name}-{config hash[:8]}``: rerunning the same config resumes the same run."""
    return f"{cfg.trainer.experiment_name}-{cfg.config_hash()[:8]}"


def family_tags(cfg: VerlFlowConfig) -> dict[str, str]:
    """Tracker tags linking a fork or replay to its parent run (siblings in MLflow, not nested runs:
    ``mlflow.parentRunId`` would make the fork a part of its parent); none for a run of its own."""
    p = cfg.parent
    if p is None:
        return {}
    tags = {
        "verl_flow.parent_run_id": p.run_id,
        "verl_flow.parent_iteration": str(p.iteration),
        "verl_flow.kind": "replay" if p.replay else "fork",
    }
    if p.rewards is not None:
        tags["verl_flow.replay_rewards"] = p.rewards
    return tags


def start_run(
    cfg: VerlFlowConfig, run_id: str | None = None, origin: dict[str, Any] | None = None
) -> RunContext:
    """Write ``run.json`` (resolved config, hash, code version, ``origin``: what the run started from)
    and create/resume the MLflow and W&B runs of ``tracking.backends``."""
    run_id = run_id or default_run_id(cfg)
    if cfg.tracking.enabled and "wandb" in cfg.tracking.backends:
        require_wandb()  # before any work: one line naming the fix
    store = ArtifactStore(
        cfg.store.url, max_attempts=cfg.store.max_attempts, outage_budget_s=cfg.store.outage_budget_s
    )
    acquire_run_lease(store, run_id, cfg.store.lease_ttl_s)  # refuses a run id another process holds
    try:
        return _start(cfg, store, run_id, origin)
    except BaseException:
        release_run_lease(store.url, run_id)
        raise


def _start(
    cfg: VerlFlowConfig, store: ArtifactStore, run_id: str, origin: dict[str, Any] | None = None
) -> RunContext:
    config_hash = cfg.config_hash()
    store.write_run_record(run_id, config_dump(cfg), config_hash, origin)
    tracking_uri = mlflow_run_id = None
    tags = {"verl_flow.config_hash": config_hash, "verl_flow.store": store.url, **family_tags(cfg)}
    if cfg.tracking.enabled and "mlflow" in cfg.tracking.backends:
        tracking_uri = cfg.tracking.uri or default_tracking_uri(store.url)
        tracker = MlflowTracker.start(
            tracking_uri,
            experiment=experiment_name(cfg.trainer.project_name),
            run_id=run_id,
            params=flatten_config(cfg),
            store_url=store.url,
        )
        tracker.set_tags(tags)
        mlflow_run_id = tracker.run_id
    wandb = wandb_fields(cfg, store.url, run_id)
    if wandb:
        w = WandbTracker.start(
            wandb["wandb_run_id"],
            wandb["wandb_project"],
            name=run_id,
            entity=wandb["wandb_entity"],
            params=flatten_config(cfg),
        )
        w.set_tags(tags)
    return RunContext(
        run_id=run_id,
        store_url=store.url,
        store_max_attempts=cfg.store.max_attempts,
        store_outage_budget_s=cfg.store.outage_budget_s,
        tracking_uri=tracking_uri,
        mlflow_run_id=mlflow_run_id,
        **wandb,
        config_hash=config_hash,
    )
