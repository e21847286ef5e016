"""A run's resolved config (``/run/RUN/config``), flattened, secrets redacted as the trackers log them
(:meth:`browse.queries.Catalog.run_config`); a box filters the keys."""

from __future__ import annotations

from dash import Dash, Input, Output, State, dcc, html

from browse.pages.runs import run_tabs
from browse.queries import Catalog


def _rows(flat: dict[str, object], needle: str) -> list[html.Tr]:
    needle = needle.lower()
    return [
        html.Tr([html.Td(html.Code(k)), html.Td(str(v))])
        for k, v in sorted(flat.items())
        if needle in k.lower() or needle in str(v).lower()
    ]


def layout(catalog: Catalog, run_id: str, query: dict[str, str]) -> html.Div:
    flat = catalog.run_config(run_id)
    return html.Div(
        [
            run_tabs(run_id),
            dcc.Store(id="config-run", data=run_id),
            html.Div(
                html.Label(["filter keys ", dcc.Input(id="config-filter", type="text", value="")]),
                className="filters",
            ),
            html.Table(
                [
                    html.Thead(html.Tr([html.Th("key"), html.Th("value")])),
                    html.Tbody(_rows(flat, ""), id="config-body"),
                ],
                id="config-table",
                className="plain",
            ),
        ]
    )


def register(app: Dash, catalog: Catalog) -> None:
    @app.callback(
        Output("config-body", "children"),
        Input("config-filter", "value"),
        State("config-run", "data"),
        prevent_initial_call=True,
    )
    def _filter(needle: str | None, run_id: str) -> list[html.Tr]:
        return _rows(catalog.run_config(run_id), needle or "")
