"""Attach to an existing run (for ``verl-flow export`` / ``eval`` / ``runs show``): its resolved config
from ``run.json`` and a :class:`RunContext` pointing at its MLflow (and W&B) run, without resuming or
re-marking anything."""

from __future__ import annotations

from verl_core.config import VerlFlowConfig, validate_config
from verl_core.runtime.run import RunContext, wandb_fields
from verl_core.runtime.tracking import RUN_ID_TAG, default_tracking_uri, experiment_name
from verl_core.store import ArtifactStore


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
