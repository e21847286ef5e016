"""A run's rescores (``/run/RUN/rescores``) and one of them (``/run/RUN/rescores/NAME``): the agreement
table (one row per rescored table, the last row all of them) and the disagreeing samples, each with
the stored verdict and the new one."""

from __future__ import annotations

import dash_ag_grid as dag
from dash import dcc, html

from browse.pages.common import error, records, run_path, table
from browse.pages.runs import run_tabs
from browse.queries import Catalog

AGREEMENT = ["source", "split", "iteration", "rows", "agreement", "accuracy_old", "accuracy_new"]
AGREEMENT += ["score_old", "score_new", "tt", "tf", "ft", "ff"]
FIRST = ["sample_id", "source", "iteration", "score_old", "score_new", "correct_old", "correct_new"]
FIRST += ["extracted_old", "extracted_new", "ground_truth", "response_text"]


def layout(catalog: Catalog, run_id: str, query: dict[str, str]) -> html.Div:
    names = catalog.rescores(run_id)
    listing = html.Ul(
        [html.Li(dcc.Link(n, href=run_path(run_id, f"rescores/{n}"))) for n in names], id="rescore-list"
    )
    name = query.get("name")
    if not name:
        body = listing if names else html.P("no rescores (verl-flow rescore RUN ...)", className="muted")
        return html.Div([run_tabs(run_id), html.H3("Rescores"), body])
    if name not in names:
        return html.Div([run_tabs(run_id), listing, error(f"no committed rescore {name!r}")])
    agreement, disagreements = catalog.rescore(run_id, name)
    cols = [c for c in AGREEMENT if c in agreement.columns]
    first = [c for c in FIRST if c in disagreements.columns]
    columns = [{"field": c} for c in first + [c for c in disagreements.columns if c not in first]]
    return html.Div(
        [
            run_tabs(run_id),
            html.H3(f"Rescore {name}", id="rescore-title"),
            table(agreement, "rescore-agreement", cols),
            html.H4(f"{len(disagreements)} disagreeing samples (stored verdict → new verdict)"),
            dag.AgGrid(
                id="rescore-disagreements",
                columnDefs=columns,
                rowData=records(disagreements),
                defaultColDef={
                    "cellDataType": False,
                    "sortable": True,
                    "resizable": True,
                    "filter": True,
                    "width": 120,
                },
                dashGridOptions={"pagination": True, "paginationPageSize": 50},
                style={"height": "480px"},
                className="ag-theme-alpine",
            ),
        ]
    )
