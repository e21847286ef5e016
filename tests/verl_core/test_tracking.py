"""MLflow tracking, read back through MlflowClient."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from verl_core.config import load_config
from verl_core.run import RunContext, default_run_id, start_run
from verl_core.tracking import RUN_ID_TAG, NullTracker, default_tracking_uri


def test_start_run_logs_params_metrics_and_resumes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    cfg = load_config(None, [f"store.url={store}"])
    ctx = start_run(cfg, "run-1")
    assert ctx.tracking_uri == f"sqlite:///{store / 'mlflow.db'}"
    assert (store / "runs" / "run-1" / "run.json").is_file()

    tracker = ctx.tracker()
    tracker.log_metrics({"reward/mean": 0.25, "actor/pg_clipfrac": 0.1, "bad": float("nan")}, step=1)
    tracker.log_metrics({"reward/mean": 0.5}, step=2)
    tracker.log_dict({"a": 1}, "reports/a.json")
    tracker.end("FINISHED")

    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    run = client.get_run(ctx.mlflow_run_id or "")
    assert run.data.params["actor.lr"] == "1e-06"
    assert run.data.params["store.url"] == str(store)
    assert run.data.tags[RUN_ID_TAG] == "run-1"
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    assert "bad" not in run.data.metrics  # NaN is not logged
    assert [f.path for f in client.list_artifacts(run.info.run_id, "reports")] == ["reports/a.json"]
    # artifacts live beside the database, not in the working directory
    assert (store / "mlartifacts").is_dir()

    # rerunning the same run id resumes the same MLflow run; a changed param becomes a tag
    cfg2 = load_config(None, [f"store.url={store}", "actor.lr=2e-6"])
    ctx2 = start_run(cfg2, "run-1")
    assert ctx2.mlflow_run_id == ctx.mlflow_run_id
    run2 = client.get_run(ctx.mlflow_run_id or "")
    assert run2.data.params["actor.lr"] == "1e-06"
    assert run2.data.tags["param_changed.actor.lr"] == "2e-06"


def test_tracking_disabled_gives_null_tracker(tmp_path: Path) -> None:
    cfg = load_config(None, [f"store.url={tmp_path}", "tracking.enabled=false"])
    ctx = start_run(cfg, "r")
    assert isinstance(ctx.tracker(), NullTracker)
    assert ctx.mlflow_run_id is None


def test_default_run_id_and_tracking_uri(tmp_path: Path) -> None:
    cfg = load_config(None, [])
    assert default_run_id(cfg) == f"quickstart-{cfg.config_hash()[:8]}"
    assert default_tracking_uri(str(tmp_path)) == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_run_context_is_serialisable() -> None:
    ctx = RunContext(run_id="r", store_url="memory://x")
    assert RunContext.model_validate_json(ctx.model_dump_json()) == ctx
