"""``verl-flow models``, ``promote``, ``rollback`` on a store's own MLflow database (the default
tracking URI: ``<store>/mlflow.db``), versions registered straight through MlflowClient."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store whose mlflow.db holds model 'tiny' with versions 1..3 (verl-flow exports: run id tag)
    and 'foreign' (not from verl-flow)."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("store")
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.create_experiment("cli")
    for name in ("tiny", "foreign"):
        client.create_registered_model(name)
        for i in range(3 if name == "tiny" else 1):
            run = client.create_run(exp).info.run_id
            tags = {"verl_flow.run_id": f"night{i + 1}", "verl_flow.iteration": "2"} if name == "tiny" else {}
            client.create_model_version(name, source=f"/fake/{i}", run_id=run, tags=tags)
    return root


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PREFECT_API_URL", "")  # no Prefect API: the promoted event is only logged
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))


def _rows(store: Path, *args: str) -> list[dict[str, str]]:
    result = runner.invoke(app, ["models", *args, "--store", str(store), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_promote_rollback_and_the_table(store: Path) -> None:
    s = ["--store", str(store)]
    assert {r["name"] for r in _rows(store)} == {"tiny"}  # only verl-flow models without NAME
    result = runner.invoke(app, ["promote", "tiny", "1", *s])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "tiny version 1 is the champion"
    result = runner.invoke(app, ["promote", "tiny", "3", "--reason", "night 3 by hand", *s])
    assert result.stdout.strip() == "tiny version 3 is the champion (was version 1)"
    rows = {r["version"]: r for r in _rows(store, "tiny")}
    assert rows["3"]["aliases"] == "champion" and rows["1"]["aliases"] == "previous-champion"
    assert (rows["3"]["by"], rows["3"]["verdict"], rows["3"]["reason"]) == (
        "hand",
        "pass",
        "night 3 by hand",
    )
    assert rows["3"]["run_id"] == "night3" and rows["2"]["verdict"] == ""  # never decided

    result = runner.invoke(app, ["rollback", "tiny", *s])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "tiny rolled back: version 1 is the champion (was version 3)"
    rows = {r["version"]: r for r in _rows(store, "tiny")}
    assert rows["1"]["aliases"] == "champion" and rows["1"]["by"] == "rollback"
    assert rows["3"]["aliases"] == ""

    # the table: one line per version, the champion's named
    result = runner.invoke(app, ["models", "tiny", *s])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stdout.splitlines() if "champion" in x)
    assert "night1" in line and "rollback" in line


def test_errors_are_one_line(store: Path, tmp_path: Path) -> None:
    s = ["--store", str(store)]
    result = runner.invoke(app, ["promote", "tiny", "9", *s])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: registered model 'tiny' has no version 9 (versions: 1, 2, 3)")
    result = runner.invoke(app, ["rollback", "foreign", *s])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: cannot roll back 'foreign': it has no 'champion' alias")
    result = runner.invoke(app, ["models", "absent", *s])
    assert result.exit_code == 1 and "no registered model 'absent'" in result.stderr
    result = runner.invoke(app, ["models", "--store", str(tmp_path / "empty")])
    assert result.exit_code == 1 and result.stderr.startswith("error: no MLflow database at ")
    assert not (tmp_path / "empty").exists()  # nothing created
