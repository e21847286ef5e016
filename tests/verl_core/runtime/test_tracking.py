"""Tracking, read back through MlflowClient; the fan-out over backends; the W&B backend's wiring (its
logging end to end: tests/flows/test_tracking_backends.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from flows.runs import run_id_of, start_run, wandb_fields
from verl_core.config import load_config
from verl_core.errors import ConfigError
from verl_core.runtime import tracking
from verl_core.runtime.run import RunContext
from verl_core.runtime.tracking import RUN_ID_TAG, Columns, FanOutTracker, NullTracker, default_tracking_uri
from verl_core.runtime.wandb_tracking import WandbTracker

TABLES_TAG = "mlflow.loggedArtifacts"  # MLflow's list of a run's tables, what load_table searches


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
    assert run_id_of(cfg) == f"quickstart-{cfg.config_hash()[:8]}"
    assert default_tracking_uri(str(tmp_path)) == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_run_context_is_serialisable() -> None:
    ctx = RunContext(run_id="r", store_url="memory://x")
    assert RunContext.model_validate_json(ctx.model_dump_json()) == ctx


def test_log_table_replaces_and_keeps_the_newest_table_names_within_mlflows_tag_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = start_run(load_config(None, [f"store.url={tmp_path}"]), "t")
    tracker = ctx.tracker()
    tracker.log_table({"a": [1, 2], "b": ["x", "y"]}, "samples/train/iter-0000.json")
    tracker.log_table({"a": [3], "b": ["z"]}, "samples/train/iter-0000.json")  # a re-run stage: replaced
    monkeypatch.setenv("MLFLOW_TRACKING_URI", ctx.tracking_uri or "")  # load_table's run search is fluent
    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    exp = client.get_experiment_by_name("verl-flow")
    assert exp is not None
    table = client.load_table(exp.experiment_id, "samples/train/iter-0000.json", run_ids=[ctx.mlflow_run_id])
    assert table.to_dict("list") == {"a": [3], "b": ["z"]}

    # each name costs ~57 characters of the 8000-character tag: 200 tables keep the newest ~140
    monkeypatch.setattr(tracking, "_MAX_TAG_CHARS", 300)  # 5 names fit
    for it in range(1, 8):
        tracker.log_table({"a": [it]}, f"samples/train/iter-{it:04d}.json")
    names = [t["path"] for t in json.loads(client.get_run(ctx.mlflow_run_id or "").data.tags[TABLES_TAG])]
    assert names == [f"samples/train/iter-{it:04d}.json" for it in range(3, 8)]
    assert len(client.list_artifacts(ctx.mlflow_run_id or "", "samples/train")) == 8  # files all stay


def test_fan_out_tracker_calls_every_backend() -> None:
    calls: list[tuple[str, str]] = []

    class Recorder(NullTracker):
        def __init__(self, name: str) -> None:
            self.name = name

        def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
            calls.append((self.name, f"metrics@{step}"))

        def log_table(self, data: Columns, artifact_file: str) -> None:
            calls.append((self.name, artifact_file))

        def end(self, status: str = "FINISHED") -> None:
            calls.append((self.name, status))

    fan = FanOutTracker([Recorder("mlflow"), Recorder("wandb")])
    fan.log_metrics({"x": 1.0}, step=3)
    fan.log_table({"a": [1]}, "samples/val/iter-0003.json")
    fan.end("FAILED")
    assert calls == [
        ("mlflow", "metrics@3"),
        ("wandb", "metrics@3"),
        ("mlflow", "samples/val/iter-0003.json"),
        ("wandb", "samples/val/iter-0003.json"),
        ("mlflow", "FAILED"),
        ("wandb", "FAILED"),
    ]


def test_backends_choose_the_trackers_and_missing_wandb_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # wandb only: no MLflow run; the W&B id is derived from store and run id (a rerun resumes it)
    cfg = load_config(None, [f"store.url={tmp_path}", "tracking.backends=[wandb]"])
    ctx = RunContext(run_id="r", store_url=str(tmp_path), **wandb_fields(cfg, str(tmp_path), "r"))
    assert isinstance(ctx.tracker(), WandbTracker) and ctx.wandb_project == "verl-flow"
    assert ctx.wandb_run_id == wandb_fields(cfg, str(tmp_path), "r")["wandb_run_id"]
    both = ctx.model_copy(update={"tracking_uri": f"sqlite:///{tmp_path / 'm.db'}", "mlflow_run_id": "m"})
    assert isinstance(both.tracker(), FanOutTracker)
    off = load_config(None, [f"store.url={tmp_path}", "tracking.backends=[wandb]", "tracking.enabled=false"])
    assert wandb_fields(off, str(tmp_path), "r") == {}

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec gives None
    with pytest.raises(ConfigError) as err:
        start_run(cfg, "r")
    assert str(err.value) == (
        "tracking.backends: 'wandb' needs the wandb package, which is not installed "
        "(pip install 'verl-flow[wandb]')"
    )
    assert not (tmp_path / "runs" / "r").exists()  # refused before any work


def test_runs_starting_at_once_share_the_experiment_whoever_creates_it() -> None:
    # two runs on a fresh tracking server: both see no experiment, the other one creates it first and
    # this one's create is refused (RESOURCE_ALREADY_EXISTS): it reads the winner's id
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS

    from verl_core.runtime.tracking import _experiment_id

    class RacingClient:
        def __init__(self) -> None:
            self.reads = 0

        def get_experiment_by_name(self, name: str) -> Any:
            self.reads += 1
            return None if self.reads == 1 else SimpleNamespace(experiment_id="7")

        def create_experiment(self, name: str, artifact_location: str | None = None) -> str:
            raise MlflowException("Experiment(name=verl-flow) already exists", RESOURCE_ALREADY_EXISTS)

    assert _experiment_id(RacingClient(), "verl-flow", None) == "7"
