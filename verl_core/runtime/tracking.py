"""Tracking: one MLflow run (and with ``tracking.backends`` [..., "wandb"] one W&B run, see
:mod:`verl_core.runtime.wandb_tracking`) per verl-flow run, resumed when the run is rerun.

Where: ``tracking.uri`` (an ``mlflow server``, any MLflow URI); unset, ``$MLFLOW_TRACKING_URI`` as
MLflow and verl read it; neither, a SQLite database ``mlflow.db`` at the root of a local artifact
store (one database for every run under that root, so ``mlflow ui`` compares them), artifacts beside
it in ``mlartifacts/`` (:func:`default_tracking_uri`). The MLflow experiment is
``trainer.project_name``; left at its default, ``$MLFLOW_EXPERIMENT_NAME`` when set
(:func:`experiment_name`). Params are the flattened config with secrets redacted; metrics are logged
in batches with their step.

Uses ``MlflowClient`` directly (no global active run), so stages can attach to the run by id.
Several backends at once: :class:`FanOutTracker`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from verl_core.store.store import normalize_url

RUN_ID_TAG = "verl_flow.run_id"
CHILD_TAG = "verl_flow.child"  # a child run's key under its parent (e.g. "rescore/strict")
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests the run under its parent
_BATCH = 100
# MLflow lists a run's tables (what mlflow.load_table searches) in one tag of at most this many characters
_LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"
_MAX_TAG_CHARS = 8000

Columns = Mapping[str, Sequence[Any]]  # a table: column name → values, every column the same length


class Tracker(Protocol):
    """What stages log to. :class:`MlflowTracker`, :class:`~verl_core.runtime.wandb_tracking.WandbTracker`,
    :class:`FanOutTracker` and :class:`NullTracker` implement it."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_table(self, data: Columns, artifact_file: str) -> None: ...
    def log_dict(self, obj: Any, artifact_file: str) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: Mapping[str, str]) -> None: ...
    def end(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    """Tracking disabled: every call does nothing."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_table(self, data: Columns, artifact_file: str) -> None:
        pass

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
        pass

    def end(self, status: str = "FINISHED") -> None:
        pass


TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
EXPERIMENT_NAME_ENV = "MLFLOW_EXPERIMENT_NAME"


def default_tracking_uri(store_url: str, *, create: bool = True) -> str:
    """The tracking URI when ``tracking.uri`` is unset: ``$MLFLOW_TRACKING_URI`` when set (non-empty);
    else ``sqlite:///<store root>/mlflow.db`` for a local store, for a remote store (which cannot hold
    a SQLite file) ``sqlite:///<cwd>/mlflow.db``. ``create`` makes the directory of the SQLite file."""
    from_env = os.environ.get(TRACKING_URI_ENV, "").strip()
    if from_env:
        return from_env
    url = normalize_url(store_url)
    root = Path(url[len("file://") :]) if url.startswith("file://") else Path.cwd()
    if create:
        root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def experiment_name(project_name: str) -> str:
    """The MLflow experiment of a run whose ``trainer.project_name`` is ``project_name``: that name, or
    ``$MLFLOW_EXPERIMENT_NAME`` (when set, non-empty) if the project name is the schema's default."""
    from verl_core.config import TrainerConfig

    from_env = os.environ.get(EXPERIMENT_NAME_ENV, "").strip()
    default = TrainerConfig.model_fields["project_name"].default
    return from_env if from_env and project_name == default else project_name


def _artifact_root(tracking_uri: str, store_url: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside the SQLite file; the server's default else."""
    if tracking_uri.startswith("sqlite:///"):
        return (Path(tracking_uri[len("sqlite:///") :]).parent / "mlartifacts").as_uri()
    return None


class MlflowTracker:
    """Logs to one MLflow run through ``MlflowClient``."""

    def __init__(self, tracking_uri: str, mlflow_run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.run_id = mlflow_run_id
        self.client = MlflowClient(tracking_uri=tracking_uri)

    @classmethod
    def start(
        cls,
        tracking_uri: str,
        experiment: str,
        run_id: str,
        params: Mapping[str, str],
        store_url: str,
    ) -> MlflowTracker:
        """Create the MLflow run for ``run_id`` (or resume the one tagged with it) and log params."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        exp_id = _experiment_id(client, experiment, _artifact_root(tracking_uri, store_url))
        found = client.search_runs([exp_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1)
        if found:
            mlflow_run_id = found[0].info.run_id
            client.update_run(mlflow_run_id, status="RUNNING")
            logged = found[0].data.params
        else:
            mlflow_run_id = client.create_run(exp_id, run_name=run_id, tags={RUN_ID_TAG: run_id}).info.run_id
            logged = {}
        tracker = cls(tracking_uri, mlflow_run_id)
        tracker._log_params(params, logged)
        return tracker

    @classmethod
    def start_child(cls, tracking_uri: str, parent_run_id: str, key: str, run_name: str) -> MlflowTracker:
        """The MLflow run nested under ``parent_run_id`` (tag ``mlflow.parentRunId``) whose
        ``verl_flow.child`` tag is ``key``: created in the parent's experiment, or found again (a rerun
        logs into the same child). It has no ``verl_flow.run_id`` tag, so the run's own lookup never
        finds it."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        exp_id = client.get_run(parent_run_id).info.experiment_id
        query = f"tags.`{PARENT_TAG}` = '{parent_run_id}' and tags.`{CHILD_TAG}` = '{key}'"
        found = client.search_runs([exp_id], filter_string=query, max_results=1)
        if found:
            client.update_run(found[0].info.run_id, status="RUNNING")
            return cls(tracking_uri, found[0].info.run_id)
        tags = {PARENT_TAG: parent_run_id, CHILD_TAG: key}
        return cls(tracking_uri, client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id)

    def _log_params(self, params: Mapping[str, str], logged: Mapping[str, str]) -> None:
        # MLflow params are immutable: a rerun with a changed value records it as a tag instead.
        from mlflow.entities import Param, RunTag

        new = [Param(k, v) for k, v in params.items() if k not in logged]
        changed = [
            RunTag(f"param_changed.{k}", v) for k, v in params.items() if k in logged and logged[k] != v
        ]
        for i in range(0, len(new), _BATCH):
            self.client.log_batch(self.run_id, params=new[i : i + _BATCH])
        if changed:
            self.client.log_batch(self.run_id, tags=changed)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log finite metrics at ``step`` in batches (non-finite values are skipped and counted)."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items() if math.isfinite(float(v))]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + _BATCH])

    def log_table(self, data: Columns, artifact_file: str) -> None:
        """Log ``data`` as the JSON table ``artifact_file`` (``*.json``), readable with
        ``mlflow.load_table``. Unlike ``MlflowClient.log_table`` a second call replaces the table
        rather than appending to it (a re-run stage logs its rows once), and the run's list of tables
        keeps only the newest names that fit MLflow's tag limit (older tables stay as files)."""
        import pandas as pd

        self.log_text(pd.DataFrame(dict(data)).to_json(orient="split", index=False), artifact_file)
        run = self.client.get_run(self.run_id)
        entry = {"path": artifact_file, "type": "table"}
        tables = [t for t in json.loads(run.data.tags.get(_LOGGED_ARTIFACTS_TAG, "[]")) if t != entry]
        tables.append(entry)
        while len(json.dumps(tables)) > _MAX_TAG_CHARS:
            tables.pop(0)
        self.client.set_tag(self.run_id, _LOGGED_ARTIFACTS_TAG, json.dumps(tables))

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.log_text(json.dumps(obj, indent=2, sort_keys=True, default=str), artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, local_path, artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def end(self, status: str = "FINISHED") -> None:
        """Mark the MLflow run FINISHED / FAILED / KILLED."""
        self.client.set_terminated(self.run_id, status=status)


class FanOutTracker:
    """Every call goes to each of ``trackers`` in turn (``tracking.backends`` with several names)."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = tuple(trackers)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for t in self.trackers:
            t.log_metrics(metrics, step)

    def log_table(self, data: Columns, artifact_file: str) -> None:
        for t in self.trackers:
            t.log_table(data, artifact_file)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        for t in self.trackers:
            t.log_dict(obj, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        for t in self.trackers:
            t.log_text(text, artifact_file)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        for t in self.trackers:
            t.log_artifact(local_path, artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for t in self.trackers:
            t.set_tags(tags)

    def end(self, status: str = "FINISHED") -> None:
        for t in self.trackers:
            t.end(status)


def log_bytes(tracker: Tracker, data: bytes, artifact_file: str) -> None:
    """Log raw bytes as an artifact file (through a temporary local file)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(artifact_file).name
        path.write_bytes(data)
        parent = str(Path(artifact_file).parent)
        tracker.log_artifact(str(path), None if parent == "." else parent)


def _experiment_id(client: Any, experiment: str, artifact_location: str | None) -> str:
    """The id of ``experiment``, created if missing; runs starting at once on a fresh tracking server
    race to create it, and the losers read the winner's."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        return str(exp.experiment_id)
    try:
        return str(client.create_experiment(experiment, artifact_location=artifact_location))
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return str(client.get_experiment_by_name(experiment).experiment_id)
