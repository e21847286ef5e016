"""Tracking end to end on the reliability suite's tiny pipeline (`verl-flow run`, real Prefect): the
per-sample tables of every RL iteration and validation read back from MLflow (``load_table``), the same
metrics, tables and plots in an offline W&B run read back from its ``.wandb`` file, the W&B API key in
nothing written, and ``tracking.log_samples=0`` logging no table."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from flows.cli import app
from verl_core.runtime.tracking import RUN_ID_TAG

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "tests" / "reliability" / "tiny.yaml")
CANARY = "wandb-canary-0123456789abcdef0123456789abcdef"  # a fake API key (40 characters like a real one)
TRAIN_COLUMNS = [
    "iteration",
    "group_id",
    "sample_index",
    "prompt",
    "response",
    "response_length",
    "score",
    "advantage",
]


def _run(tmp_path: Path, *overrides: str) -> str:
    args = [
        "run",
        TINY,
        f"store.url={tmp_path / 'store'}",
        "tracking.enabled=true",
        "trainer.test_freq=1",  # validation after each of the 2 iterations
        "export.enable=false",
        *overrides,
        "--run-id",
        "t",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output


def _mlflow_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[MlflowClient, str, str]:
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # load_table searches runs through the fluent API
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("verl-flow")
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id], f"tags.`{RUN_ID_TAG}` = 't'")
    return client, exp.experiment_id, run.info.run_id


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` transaction log (W&B 0.31 ships no Python reader): a 7-byte header
    (``:W&B``, magic 0xBEE1, version), then LevelDB-log blocks of 32 KiB whose chunks carry a 7-byte
    header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) around protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_samples_metrics_and_plots_reach_mlflow_and_offline_wandb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_API_KEY", CANARY)
    output = _run(tmp_path, "tracking.backends=[mlflow,wandb]", "tracking.log_samples=3")

    # MLflow: one train table per iteration (0, 1) and one val table per validation (1, 2), 3 rows each
    client, exp_id, run_id = _mlflow_run(tmp_path, monkeypatch)
    tables = {}
    for kind, iterations in (("train", (0, 1)), ("val", (1, 2))):
        for it in iterations:
            table = client.load_table(exp_id, f"samples/{kind}/iter-{it:04d}.json", run_ids=[run_id])
            expected = TRAIN_COLUMNS if kind == "train" else TRAIN_COLUMNS[:-1]
            assert list(table.columns) == expected and len(table) == 3, (kind, it)
            assert set(table["iteration"]) == {it} and table["prompt"].str.contains("Subtract|Add").all()
            tables[kind, it] = table
    # the first 3 samples: with rollout.n=2 prompt 0's two and prompt 1's first; validation: 1 per prompt
    keys = ["group_id", "sample_index"]
    assert list(tables["train", 1][keys].itertuples(index=False, name=None)) == [(0, 0), (0, 1), (1, 0)]
    assert list(tables["val", 2][keys].itertuples(index=False, name=None)) == [(0, 0), (1, 0), (2, 0)]

    # W&B: the offline run of this run id holds the same metrics, both kinds of tables and the plots
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    history: dict[str, list[Any]] = {}
    files: set[str] = set()
    config: dict[str, Any] = {}
    for record in _wandb_records(next(run_dir.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            for item in record.history.item:
                history.setdefault(item.key or "/".join(item.nested_key), []).append(
                    json.loads(item.value_json)
                )
        elif kind == "files":
            files |= {f.path for f in record.files.files}
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
    assert config["trainer.experiment_name"] == "reliability"  # the flattened config, as MLflow params
    mlflow_metrics = client.get_run(run_id).data.metrics
    for key in ("val/accuracy", "actor/pg_loss", "sft/val_loss"):
        assert key in history and key in mlflow_metrics, key
    assert len(history["actor/pg_loss"]) == 2  # one per iteration
    for table_key in ("samples/train/iter-0001", "samples/val/iter-0002"):
        assert history[f"{table_key}/nrows"] == [3] and history[f"{table_key}/_type"] == ["table-file"]
    (table_file,) = (run_dir / "files").glob("media/table/samples/train/iter-0001_*.table.json")
    table_json = json.loads(table_file.read_text())
    assert table_json["columns"] == TRAIN_COLUMNS and len(table_json["data"]) == 3
    assert {"plots/kl.png", "plots/report.md", "pipeline_result.json"} <= files

    # the API key is in nothing the run wrote (store, MLflow, W&B dir) nor printed
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in written) and any(p.name == "mlflow.db" for p in written)
    assert [str(p) for p in written if CANARY.encode() in p.read_bytes()] == []
    assert CANARY not in output


def test_log_samples_zero_logs_no_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path, "tracking.log_samples=0", "trainer.total_iterations=1")
    client, _, run_id = _mlflow_run(tmp_path, monkeypatch)
    assert "val/accuracy" in client.get_run(run_id).data.metrics  # tracked, only without samples
    assert client.list_artifacts(run_id, "samples") == []
    assert "mlflow.loggedArtifacts" not in client.get_run(run_id).data.tags
