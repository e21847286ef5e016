"""MLflow's own environment variables, as MLflow and verl honour them: ``MLFLOW_TRACKING_URI`` when
``tracking.uri`` is unset, ``MLFLOW_EXPERIMENT_NAME`` when ``trainer.project_name`` is left at its
default. Before: both were ignored, and a user with an MLflow server exported found nothing there."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.runs import attach_run, start_run
from verl_core.config import load_config
from verl_core.runtime.tracking import RUN_ID_TAG, default_tracking_uri, experiment_name


def test_the_variables_fill_only_what_the_config_leaves_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    assert default_tracking_uri(str(tmp_path)) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert experiment_name("verl-flow") == "verl-flow"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    assert default_tracking_uri(str(tmp_path)) == "http://mlflow.example:5000"
    assert experiment_name("verl-flow") == "from-env"  # the schema's default project name
    assert experiment_name("mine") == "mine"  # a project name the config gives wins


def test_a_run_logs_where_the_variables_say_and_is_found_there_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}"  # stands for an MLflow server
    (tmp_path / "server").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-exp")
    store = tmp_path / "store"
    ctx = start_run(load_config(None, [f"store.url={store}"]), "r1")  # tracking.uri unset
    assert ctx.tracking_uri == elsewhere
    assert not (store / "mlflow.db").exists()  # not the default beside the store
    client = MlflowClient(tracking_uri=elsewhere)
    exp = client.get_experiment_by_name("team-exp")
    assert exp is not None
    [found] = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = 'r1'")
    assert found.info.run_id == ctx.mlflow_run_id
    attached, _ = attach_run(str(store), "r1")  # export, eval, rescore find the same run
    assert attached.mlflow_run_id == ctx.mlflow_run_id
    ctx.tracker().end()
