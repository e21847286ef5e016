"""A set's samples (``/run/RUN/samples?kind=&key=``): filter controls, an AG Grid page of rows that
:meth:`browse.queries.Catalog.samples` answers (filters, sorting and paging happen on the server, in
DuckDB; the grid holds one page), and links from each row to its group and its tokens.

The query string presets the filters, so a filtered view can be linked:
``?kind=train&key=iter-0003&correct=false&text=carry``. Keys: data_source, correct, reward_min,
reward_max, length_min, length_max, truncated, tools, policy_version, text, garbled; page_size."""

from __future__ import annotations

from typing import Any, Literal

import dash_ag_grid as dag
from dash import Dash, Input, Output, State, callback_context, dcc, html

from browse.pages.common import error, href, kind_of, records
from browse.pages.runs import run_tabs
from browse.queries import Catalog, SampleFilter

PAGE_SIZE = 50  # rows of one page (the query string's page_size, up to MAX_PAGE_SIZE)
MAX_PAGE_SIZE = 500
COUNT_POLL_MS = 1000  # how soon the grid asks for a count not known with its page (the ask waits
# for it; every tick while it waits asks again, so not much more often)
TRI = [{"label": "any", "value": ""}, {"label": "yes", "value": "true"}, {"label": "no", "value": "false"}]
# (control id, query key, label, input type) of the numeric and text filters
INPUTS: tuple[tuple[str, str, str, Literal["text", "number"]], ...] = (
    ("f-data-source", "data_source", "data source", "text"),
    ("f-reward-min", "reward_min", "reward ≥", "number"),
    ("f-reward-max", "reward_max", "reward ≤", "number"),
    ("f-length-min", "length_min", "length ≥", "number"),
    ("f-length-max", "length_max", "length ≤", "number"),
    ("f-policy", "policy_version", "policy version", "number"),
    ("f-text", "text", "text in prompt/response", "text"),
)
# (control id, query key, label) of the yes/no/any filters
TRIS = (
    ("f-correct", "correct", "correct"),
    ("f-truncated", "truncated", "truncated"),
    ("f-tools", "tools", "tool calls"),
    ("f-garbled", "garbled", "garbled"),
)
COLUMNS = [
    {"field": "links", "headerName": "", "cellRenderer": "markdown", "sortable": False, "width": 120},
    {"field": "sample_id", "headerName": "sample", "width": 90},
    {"field": "prompt_id", "headerName": "prompt id", "width": 95},
    {"field": "data_source", "headerName": "data source", "width": 150},
    {"field": "prompt", "headerName": "prompt", "width": 260, "tooltipField": "prompt"},
    {"field": "response", "headerName": "response", "width": 320, "tooltipField": "response"},
    {"field": "reward", "headerName": "reward", "width": 85},
    {"field": "correct", "headerName": "correct", "width": 85},
    {"field": "advantage", "headerName": "advantage", "width": 100},
    {"field": "response_length", "headerName": "length", "width": 85},
    {"field": "truncated", "headerName": "truncated", "width": 95},
    {"field": "tool_calls", "headerName": "tools", "width": 75},
    {"field": "policy_version", "headerName": "policy", "width": 80},
    {"field": "extracted_answer", "headerName": "extracted", "width": 100},
    {"field": "ground_truth", "headerName": "truth", "width": 90},
    {"field": "garbled_reason", "headerName": "garbled", "width": 120},
]
PREVIEW = 300  # characters of prompt / response sent to the grid


def _tri(value: str | None) -> bool | None:
    return {"true": True, "false": False}.get(value or "")


def _num(value: Any, cast: type = float) -> Any:
    if value is None or value == "":
        return None
    return cast(value)


def build_filter(values: dict[str, Any]) -> SampleFilter:
    """The controls' values (by query key) as a :class:`SampleFilter`."""
    return SampleFilter(
        data_source=values.get("data_source") or None,
        correct=_tri(values.get("correct")),
        reward_min=_num(values.get("reward_min")),
        reward_max=_num(values.get("reward_max")),
        length_min=_num(values.get("length_min"), int),
        length_max=_num(values.get("length_max"), int),
        truncated=_tri(values.get("truncated")),
        has_tool_calls=_tri(values.get("tools")),
        policy_version=_num(values.get("policy_version"), int),
        text=values.get("text") or None,
        garbled=_tri(values.get("garbled")),
    )


def _page_size(text: str | None) -> int:
    return min(int(text), MAX_PAGE_SIZE) if text and text.isdigit() and int(text) > 0 else PAGE_SIZE


def _set_value(kind: str, key: str) -> str:
    return f"{kind}|{key}"


def layout(catalog: Catalog, run_id: str, query: dict[str, str]) -> html.Div:
    sets = records(catalog.sample_sets(run_id))
    if not sets:
        return html.Div([run_tabs(run_id), error("this run has no committed samples yet")])
    options = [
        {"label": f"{s['kind']} {s['key']} ({s['rows']} rows)", "value": _set_value(s["kind"], s["key"])}
        for s in sets
    ]
    chosen = (
        _set_value(query["kind"], query["key"]) if "kind" in query and "key" in query else options[0]["value"]
    )
    if chosen not in {o["value"] for o in options}:
        return html.Div(
            [run_tabs(run_id), error(f"no committed sample set {chosen.replace('|', ' ')} in this run")]
        )
    controls: list[Any] = [
        html.Div(
            [
                html.Span("sample set"),
                dcc.Dropdown(
                    id="samples-set", options=options, value=chosen, clearable=False, style={"width": "300px"}
                ),
            ],
            className="control",
        )
    ]
    for cid, key, label, kind in INPUTS:
        box = dcc.Input(id=cid, type=kind, value=query.get(key), debounce=True)
        controls.append(html.Div([html.Span(label), box], className="control"))
    for cid, key, label in TRIS:
        radio = dcc.RadioItems(id=cid, options=TRI, value=query.get(key, ""), inline=True, className="radios")
        controls.append(html.Div([html.Span(label), radio], className="control"))
    return html.Div(
        [
            run_tabs(run_id),
            dcc.Store(id="samples-run", data=run_id),
            dcc.Store(id="samples-page", data=0),
            dcc.Store(id="samples-size", data=_page_size(query.get("page_size"))),
            # on while a garbled filter's page came before its count: asks again for the count
            dcc.Interval(id="samples-count-poll", interval=COUNT_POLL_MS, disabled=True),
            html.Div(controls, className="filters"),
            html.Div(
                [
                    html.Button("◀ previous", id="samples-prev"),
                    html.Span(id="samples-page-label"),
                    html.Button("next ▶", id="samples-next"),
                    html.Span(id="samples-total"),
                ],
                className="pager",
            ),
            dag.AgGrid(
                id="samples-grid",
                columnDefs=COLUMNS,
                rowData=[],
                defaultColDef={"cellDataType": False, "sortable": True, "resizable": True},
                dashGridOptions={"tooltipShowDelay": 300, "suppressMultiSort": False},
                style={"height": "620px"},
                className="ag-theme-alpine",
            ),
        ]
    )


def _sort(column_state: list[dict[str, Any]] | None) -> list[tuple[str, bool]]:
    """AG Grid's column state → ``[(column, ascending)]`` in the user's sort order."""
    sorted_cols = [c for c in column_state or [] if c.get("sort") and c.get("colId") != "links"]
    sorted_cols.sort(key=lambda c: c.get("sortIndex") or 0)
    return [(c["colId"], c["sort"] == "asc") for c in sorted_cols]


def _rows(run_id: str, kind: str, key: str, page: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for r in page:
        group = href(run_id, "group", kind=kind, key=key, prompt=r.get("prompt_id"))
        toks = href(
            run_id, "tokens", kind=kind, key=key, sample=r.get("sample_id"), prompt=r.get("prompt_id")
        )
        r["links"] = f"[group]({group}) · [tokens]({toks})"
        for col in ("reward", "advantage"):  # shown rounded; sorting happens on the server's values
            if isinstance(r.get(col), float):
                r[col] = float(f"{r[col]:.4g}")
        for col in ("prompt", "response"):
            text = r.get(col) or ""
            r[col] = text if len(text) <= PREVIEW else text[:PREVIEW] + "…"
    return page


def register(app: Dash, catalog: Catalog) -> None:
    inputs = [Input(cid, "value") for cid, _, _, _ in INPUTS] + [Input(cid, "value") for cid, _, _ in TRIS]
    keys = [key for _, key, _, _ in INPUTS] + [key for _, key, _ in TRIS]

    @app.callback(
        Output("samples-grid", "rowData"),
        Output("samples-total", "children"),
        Output("samples-page-label", "children"),
        Output("samples-page", "data"),
        Output("samples-count-poll", "disabled"),
        Input("samples-set", "value"),
        Input("samples-count-poll", "n_intervals"),
        Input("samples-prev", "n_clicks"),
        Input("samples-next", "n_clicks"),
        Input("samples-grid", "columnState"),
        *inputs,
        State("samples-page", "data"),
        State("samples-size", "data"),
        State("samples-run", "data"),
    )
    def _page(
        set_value: str, _poll: Any, _prev: Any, _next: Any, column_state: Any, *rest: Any
    ) -> tuple[Any, ...]:
        values, page, size, run_id = (
            dict(zip(keys, rest[:-3], strict=True)),
            rest[-3] or 0,
            rest[-2],
            rest[-1],
        )
        trigger = callback_context.triggered_id
        if trigger == "samples-prev":
            page = max(page - 1, 0)
        elif trigger == "samples-next":
            page += 1
        elif trigger == "samples-count-poll":
            pass  # the count of the page shown (it waits for the set's garbled flags)
        else:
            page = 0  # a new filter, sort or set starts at the first page
        kind, key = set_value.split("|", 1)
        try:
            filters = build_filter(values)
        except ValueError as e:
            return [], f"bad filter: {e}", "", page, True
        sort = _sort(column_state)
        early = trigger != "samples-count-poll"  # a garbled filter's page first, its count next
        df, total = catalog.samples(run_id, kind_of(kind), key, filters, sort, page * size, size, early)
        if total is None:  # the page is right; the count fills in when the flags are in
            rows = _rows(run_id, kind, key, records(df))
            return rows, "counting… matching samples", f"page {page + 1}", page, False
        pages = max((total + size - 1) // size, 1)
        if page >= pages:  # "next" past the end
            page = pages - 1
            df, total = catalog.samples(run_id, kind_of(kind), key, filters, sort, page * size, size)
        rows = _rows(run_id, kind, key, records(df))
        return rows, f"{total} matching samples", f"page {page + 1} of {pages}", page, True
