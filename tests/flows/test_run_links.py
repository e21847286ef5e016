"""flows.run_links: what a run records of its Prefect flow run and MLflow run, and the page URLs
(only where a UI serves them). The recording inside a real pipeline flow run is checked end to end
by tests/browse/test_browser_multi_turn.py (a temporary Prefect server, MLflow in SQLite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flows import run_links
from flows.run_links import flow_run_page, mlflow_run_page, prefect_ui_url, read_links, record_links
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore


def test_mlflow_page_only_for_a_tracking_server() -> None:
    assert (
        mlflow_run_page("http://mlflow.local:5000/", "3", "abc")
        == "http://mlflow.local:5000/#/experiments/3/runs/abc"
    )
    assert mlflow_run_page("sqlite:////tmp/s/mlflow.db", "3", "abc") is None  # a database: no UI
    assert mlflow_run_page("file:///tmp/mlruns", "3", "abc") is None
    assert mlflow_run_page("https://***@mlflow.local", "3", "abc") is None  # credentials stripped: no link


def test_prefect_ui_from_the_configured_api() -> None:
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    with temporary_settings(
        {PREFECT_API_URL: "http://prefect.local:4200/api"}, restore_defaults={PREFECT_UI_URL}
    ):
        ui = prefect_ui_url()
    assert ui == "http://prefect.local:4200"  # derived from the API URL: /api dropped
    assert flow_run_page(ui, "f-1") == "http://prefect.local:4200/flow-runs/flow-run/f-1"
    with temporary_settings({PREFECT_UI_URL: "https://ui.example/"}, restore_defaults={PREFECT_API_URL}):
        assert prefect_ui_url() == "https://ui.example"


def test_record_and_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a flow run and with tracking off nothing is known; a recorded MLflow tracking URI
    never holds credentials."""
    store = ArtifactStore(str(tmp_path))
    store.write_run_record("r", {}, "h")
    assert read_links(store, "r") == {"prefect": None, "mlflow": None}  # none recorded
    ctx = RunContext(run_id="r", store_url=str(tmp_path))
    assert record_links(ctx) == {"prefect": None, "mlflow": None}
    assert read_links(store, "r") == {"prefect": None, "mlflow": None}

    def fake(ctx: RunContext) -> dict[str, Any]:
        return {
            "prefect": None,
            "mlflow": {"tracking_uri": run_links.redact_url("https://user:pw@mlflow.local"), "run_id": "m"},
        }

    monkeypatch.setattr(run_links, "current_links", fake)
    record_links(ctx)
    assert read_links(store, "r")["mlflow"]["tracking_uri"] == "https://***@mlflow.local"
    (tmp_path / "runs" / "r" / "links.json").write_text("{not json")
    assert read_links(store, "r") == {"prefect": None, "mlflow": None}  # unreadable: no links
