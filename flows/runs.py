"""Start a run from its config, or attach to an existing one.

:func:`start_run` (the pipeline, at its start) creates or resumes run ``run_id``: takes the run's lease
(one live process per run id, :mod:`verl_core.store.lease`), writes ``run.json`` (the resolved config,
its hash, the code version, what the run started from) and creates/resumes the MLflow and W&B runs;
:func:`verl_core.runtime.run.end_run` releases the lease. :func:`attach_run` (``verl-flow export`` /
``eval`` / ``runs show``) reads a run's resolved config from ``run.json`` and a :class:`RunContext`
pointing at its MLflow (and W&B) run, without resuming or re-marking anything.

These take the config object, so they live above verl_core, which never does.
"""

from __future__ import annotations

from typing import Any

from verl_core.config import VerlFlowConfig, config_dump, flatten_config, validate_config
from verl_core.runtime.run import RunContext, default_run_id
from verl_core.runtime.tracking import (
    RUN_ID_TAG,
    MlflowTracker,
    default_tracking_uri,
    experiment_name,
)
from verl_core.runtime.wandb_tracking import WandbTracker, require_wandb, wandb_run_id
from verl_core.store import ArtifactStore
from verl_core.store.lease import acquire_run_lease, release_run_lease


def run_id_of(cfg: VerlFlowConfig) -> str:
    """The run id of ``cfg`` when none is given: ``{trainer.experiment_name}-{config hash[:8]}``
    (:func:`verl_core.runtime.run.default_run_id`); rerunning the same config resumes the same run."""
    return default_run_id(cfg.trainer.experiment_name, cfg.config_hash())


def attach_run(store_url: str, run_id: str) -> tuple[RunContext, VerlFlowConfig]:
    """The context and config of ``run_id`` in the store at ``store_url``."""
    store = ArtifactStore(store_url)
    record = store.read_run_record(run_id)
    # the run was made in this store: keep it there whatever the recorded URL spelling
    raw = {**record.config, "store": {**record.config.get("store", {}), "url": store.url}}
    raw["execution"] = {**raw.get("execution", {}), "mode": "local"}
    cfg = validate_config(raw)
    tracking_uri = mlflow_run_id = None
    if cfg.tracking.enabled and "mlflow" in cfg.tracking.backends:
        tracking_uri = cfg.tracking.uri or default_tracking_uri(store.url)
        mlflow_run_id = find_mlflow_run(tracking_uri, experiment_name(cfg.trainer.project_name), run_id)
    ctx = RunContext(
        run_id=run_id,
        store_url=store.url,
        store_max_attempts=cfg.store.max_attempts,
        store_outage_budget_s=cfg.store.outage_budget_s,
        tracking_uri=tracking_uri if mlflow_run_id else None,
        mlflow_run_id=mlflow_run_id,
        **wandb_fields(cfg, store.url, run_id),
        config_hash=record.config_hash,
    )
    return ctx, cfg


def find_mlflow_run(tracking_uri: str, experiment: str, run_id: str) -> str | None:
    """The MLflow run id tagged with ``run_id`` in ``experiment``, or None."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    found = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1
    )
    return found[0].info.run_id if found else None


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
    run_id = run_id or run_id_of(cfg)
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
