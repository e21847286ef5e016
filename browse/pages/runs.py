"""The runs of the store (``/``) and one run's iterations as small charts (``/run/RUN``); a point of a
chart opens that iteration's training samples.

A run's MLflow run and Prefect flow run are what its pipeline recorded (:mod:`flows.run_links`): a
link where a UI serves them (an ``http(s)`` MLflow server, a configured Prefect server), else the ids
and, for MLflow's database or files, the ``mlflow ui --backend-store-uri`` command that opens them."""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go
from dash import ALL, Dash, Input, Output, callback_context, dcc, html, no_update

from browse.pages.common import data_attrs, error, fmt, href, records, run_path, table
from browse.queries import Catalog
from flows.run_links import read_links

# the charts of a run's page: (title, [(column of Catalog.iterations, trace name)])
CHARTS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "reward": (
        "reward / accuracy",
        [("reward_mean", "reward"), ("accuracy", "accuracy"), ("val_accuracy", "val")],
    ),
    "kl": ("KL to the reference", [("kl", "kl")]),
    "length": ("response length", [("response_length_mean", "mean length")]),
    "rates": ("clip and truncation rates", [("clip_frac", "clip"), ("truncated_frac", "truncated")]),
}


def mlflow_cell(found: dict[str, Any] | None) -> Any:
    """The MLflow run: a link to its page, or its id and the command that serves it."""
    if not found or not found.get("run_id"):
        return "–"
    if found.get("ui_url"):
        return html.A(
            "MLflow run", href=found["ui_url"], target="_blank", rel="noopener", className="mlflow-link"
        )
    command = f"mlflow ui --backend-store-uri {found.get('tracking_uri')}"
    return html.Div(
        [
            html.Code(found["run_id"], className="mlflow-run-id"),
            html.Div(html.Code(command), className="muted mlflow-ui"),
        ]
    )


def prefect_cell(found: dict[str, Any] | None) -> Any:
    """The Prefect flow run: a link to its page, or its name and id (no Prefect server was configured:
    the run's temporary server is gone)."""
    if not found or not found.get("flow_run_id"):
        return "–"
    name = found.get("flow_run_name") or found["flow_run_id"]
    if found.get("ui_url"):
        return html.A(
            f"flow run {name}",
            href=found["ui_url"],
            target="_blank",
            rel="noopener",
            className="prefect-link",
        )
    return html.Div(
        [
            html.Span(f"flow run {name}", title=found["flow_run_id"], className="prefect-flow-run"),
            html.Div(
                html.Code(found["flow_run_id"]), className="muted", title="no Prefect server was configured"
            ),
        ]
    )


def layout(catalog: Catalog) -> html.Div:
    """The runs: status, config hash, family links, key metrics, MLflow / Prefect links."""
    df = catalog.runs()
    if df.empty:
        return html.Div([html.H2("Runs"), error("no runs in this store")])
    head = ["run", "status", "experiment", "config", "family", "iterations", "reward", "accuracy"]
    head += ["val accuracy", "updated", "MLflow", "Prefect"]
    rows = []
    for r in records(df):
        links = read_links(catalog.store, r["run_id"])
        family: Any = "–"
        if r.get("parent"):
            family = html.Span(
                [
                    f"{r.get('link_kind') or 'child'} of ",
                    dcc.Link(r["parent"], href=run_path(r["parent"])),
                    f" @ {fmt(r.get('parent_iteration'))}",
                ]
            )
        cells = [
            dcc.Link(r["run_id"], href=run_path(r["run_id"]), className="run-link"),
            r.get("status"),
            r.get("experiment"),
            html.Code((r.get("config_hash") or "")[:12], title=r.get("config_hash") or ""),
            family,
            fmt(r.get("iterations")),
            fmt(r.get("reward_mean")),
            fmt(r.get("accuracy")),
            fmt(r.get("val_accuracy")),
            str(r.get("updated") or "")[:19],
            mlflow_cell(links["mlflow"]),
            prefect_cell(links["prefect"]),
        ]
        rows.append(html.Tr([html.Td(c) for c in cells], **data_attrs(run_id=r["run_id"])))
    tbl = html.Table(
        [html.Thead(html.Tr([html.Th(h) for h in head])), html.Tbody(rows)],
        id="runs-table",
        className="plain",
    )
    return html.Div([html.H2("Runs"), tbl])


def _sets_list(catalog: Catalog, run_id: str) -> html.Div:
    sets = catalog.sample_sets(run_id)
    items = []
    for kind in ("train", "val", "eval"):
        mine = sets[sets["kind"] == kind] if not sets.empty else sets
        if mine.empty:
            continue
        links: list[Any] = [html.B(f"{kind}: ")]
        for r in records(mine):
            links += [dcc.Link(r["key"], href=href(run_id, "samples", kind=kind, key=r["key"])), " "]
        items.append(html.Div(links))
    return html.Div(items or [html.Span("no committed samples yet", className="muted")], id="sample-sets")


def run_tabs(run_id: str) -> html.Div:
    """The links from one run's page to its other views."""
    views = [("iterations", ""), ("samples", "samples"), ("prompt across iterations", "prompt")]
    views += [("tokens", "tokens"), ("rescores", "rescores"), ("config", "config")]
    links: list[Any] = [html.B(run_id, id="run-title"), " · "]
    for text, view in views:
        links += [dcc.Link(text, href=run_path(run_id, view)), " · "]
    return html.Div(links[:-1], className="run-tabs", style={"marginBottom": "8px"})


def _figure(
    df: pd.DataFrame, sets: pd.DataFrame, run_id: str, title: str, cols: list[tuple[str, str]]
) -> go.Figure:
    fig = go.Figure()
    keys = {}
    if not sets.empty:
        train = sets[sets["kind"] == "train"]
        keys = dict(zip(train["iteration"].tolist(), train["key"].tolist(), strict=True))
    for col, name in cols:
        if col not in df.columns or df[col].isna().all():
            continue
        links = [
            href(run_id, "samples", kind="train", key=keys[i]) if i in keys else None
            for i in df["iteration"].tolist()
        ]
        fig.add_trace(
            go.Scatter(x=df["iteration"], y=df[col], name=name, mode="lines+markers", customdata=links)
        )
    if not fig.data:
        fig.add_annotation(
            text="not logged by this run", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper"
        )
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
    fig.update_layout(
        title={"text": title, "font": {"size": 13}},
        height=230,
        margin={"l": 40, "r": 10, "t": 30, "b": 30},
        xaxis={"title": "iteration", "dtick": 1},
        legend={"orientation": "h", "y": -0.3},
        showlegend=len(fig.data) > 1,
        clickmode="event",
    )
    return fig


def run_layout(catalog: Catalog, run_id: str, query: dict[str, str]) -> html.Div:
    """A run's page: its sample sets and one small chart per metric group."""
    its = catalog.iterations(run_id)
    sets = catalog.sample_sets(run_id)
    charts = [
        dcc.Graph(
            id={"type": "iter-chart", "name": name},
            figure=_figure(its, sets, run_id, title, cols),
            config={"displayModeBar": False},
        )
        for name, (title, cols) in CHARTS.items()
    ]
    shown = {col for _, cs in CHARTS.values() for col, _ in cs}
    extra = ["iteration", *[c for c in its.columns if c not in shown and c != "iteration"]]
    return html.Div(
        [
            run_tabs(run_id),
            _sets_list(catalog, run_id),
            html.P("Click a point to open that iteration's samples.", className="muted"),
            html.Div(charts, className="charts", id="iteration-charts"),
            html.Details(
                [html.Summary("all per-iteration metrics"), table(its, "iterations-table", extra[:40])]
            ),
        ]
    )


def register(app: Dash, catalog: Catalog) -> None:
    """A click on a chart's point opens the samples of that iteration."""

    @app.callback(
        Output("url", "href", allow_duplicate=True),
        Input({"type": "iter-chart", "name": ALL}, "clickData"),
        prevent_initial_call=True,
    )
    def _open_iteration(clicks: list[dict[str, Any] | None]) -> Any:
        trig = callback_context.triggered
        if not trig or not trig[0].get("value"):
            return no_update
        point = trig[0]["value"]["points"][0]
        return point.get("customdata") or no_update
