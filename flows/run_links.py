"""Where a run is tracked, recorded in its store: ``runs/{run_id}/links.json``, written by the pipeline
flow when the run starts (and again when it resumes: the latest flow run), read by the rollout
browser's runs page (``verl-flow browse``)::

    {"prefect": {"flow_run_id": ..., "flow_run_name": ..., "ui_url": ... | null},
     "mlflow": {"run_id": ..., "experiment_id": ..., "tracking_uri": ..., "ui_url": ... | null}}

Recorded, not looked up when a page shows: the run's process knows the exact ids (its flow run, the
MLflow run it created), while a browser started later may see another environment (another
``MLFLOW_TRACKING_URI``, a temporary Prefect server long gone, a tracking server that is down and
would stall the page). A page URL is recorded only where a UI serves it: Prefect's when a server is
configured (``PREFECT_UI_URL``, or derived from ``PREFECT_API_URL``; none for the temporary local
server ``verl-flow run`` starts without one), MLflow's for an ``http(s)`` tracking server. Without
one the browser shows the ids and, for MLflow, the ``mlflow ui --backend-store-uri`` command.
Credentials in a tracking URI are never written (``scheme://***@host``)."""

from __future__ import annotations

import json
import posixpath
from typing import Any

from verl_core.config.loader import redact_url
from verl_core.errors import VerlFlowError
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore

LINKS = "links.json"


def prefect_ui_url() -> str | None:
    """The Prefect UI of the configured server (``PREFECT_UI_URL``, else derived from
    ``PREFECT_API_URL``), None without one."""
    from prefect.settings import PREFECT_UI_URL

    url = PREFECT_UI_URL.value()
    return str(url).rstrip("/") if url else None


def flow_run_page(ui_url: str, flow_run_id: str) -> str:
    """A flow run's page in Prefect's UI (the path ``prefect.runtime.flow_run.ui_url`` builds)."""
    return f"{ui_url.rstrip('/')}/flow-runs/flow-run/{flow_run_id}"


def mlflow_run_page(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The MLflow run's page for an ``http(s)`` tracking server; None for a database or files (no UI)."""
    if not tracking_uri.startswith(("http://", "https://")) or "***@" in tracking_uri:
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def current_links(ctx: RunContext) -> dict[str, Any]:
    """The links of the run of ``ctx`` from inside its flow run: the flow run (None outside one) and
    the MLflow run (None with MLflow tracking off)."""
    from prefect.runtime import flow_run

    links: dict[str, Any] = {"prefect": None, "mlflow": None}
    if flow_run.id:
        ui = prefect_ui_url()
        links["prefect"] = {
            "flow_run_id": flow_run.id,
            "flow_run_name": flow_run.name,
            "ui_url": flow_run_page(ui, flow_run.id) if ui else None,
        }
    if ctx.tracking_uri and ctx.mlflow_run_id:
        from mlflow.tracking import MlflowClient

        exp = MlflowClient(tracking_uri=ctx.tracking_uri).get_run(ctx.mlflow_run_id).info.experiment_id
        links["mlflow"] = {
            "run_id": ctx.mlflow_run_id,
            "experiment_id": exp,
            "tracking_uri": redact_url(ctx.tracking_uri),
            "ui_url": mlflow_run_page(ctx.tracking_uri, str(exp), ctx.mlflow_run_id),
        }
    return links


def record_links(ctx: RunContext) -> dict[str, Any]:
    """Write ``runs/{run_id}/links.json`` (:func:`current_links`); returns what it wrote."""
    links = current_links(ctx)
    store = ctx.store()
    store.put_atomic(posixpath.join(store.run_dir(ctx.run_id), LINKS), json.dumps(links, indent=2).encode())
    return links


def read_links(store: ArtifactStore, run_id: str) -> dict[str, Any]:
    """The run's recorded links (``{"prefect": None, "mlflow": None}`` when it has none: a run from
    before they were recorded, or one not started by the pipeline flow)."""
    path = posixpath.join(store.run_dir(run_id), LINKS)
    empty: dict[str, Any] = {"prefect": None, "mlflow": None}
    try:
        found = json.loads(store.cat(path))
    except (VerlFlowError, OSError, ValueError):  # none recorded, or unreadable: no links
        return empty
    return {**empty, **(found if isinstance(found, dict) else {})}
