"""The runs of the store (``/``) and one run's iterations as small charts (``/run/RUN``); a point of a
chart opens that iteration's training samples."""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go
from dash import ALL, Dash, Input, Output, callback_context, dcc, html, no_update

from browse.pages.common import data_attrs, error, fmt, href, records, run_path, table
from browse.queries import Catalog

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


def _link(text: str, url: str | None) -> Any:
    if not url:
        return "–"
    return html.A(text, href=url, target="_blank", rel="noopener")


def layout(catalog: Catalog) -> html.Div:
    """The runs: status, config hash, family links, key metrics, MLflow / Prefect links."""
    df = catalog.runs()
    if df.empty:
        return html.Div([html.H2("Runs"), error("no runs in this store")])
    head = ["run", "status", "experiment", "config", "family", "iterations", "reward", "accuracy"]
    head += ["val accuracy", "updated", "MLflow", "Prefect"]
    rows = []
    for r in records(df):
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
            _link("MLflow run", r.get("mlflow_run_url")),
            _link("flow run", r.get("prefect_flow_run_url")),
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
