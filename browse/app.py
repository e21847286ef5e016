"""The rollout browser: a Dash app over a :class:`browse.queries.Catalog` (read-only).

Why this stack: DuckDB queries the run's Parquet files where they lie (local or ``s3://``) with
filters and sorting pushed into the scan, so a page of 100,000 samples answers in well under a
second without a database to load; Dash is a maintained Python web framework whose callbacks run
those queries on the server; AG Grid (dash-ag-grid) is the samples table (sorting, column sizing,
keyboard navigation) so no table code is hand-written; Plotly draws the per-iteration charts. Every
asset ships inside the wheels, so the pages work with no network.

One page per view, each with its own URL (``dcc.Location``), so a page can be linked:

    /                                   the runs (:mod:`browse.pages.runs`)
    /run/RUN                            its iterations as charts; a point opens that iteration's samples
    /run/RUN/samples?kind=&key=&...     a set's samples: filters, sorting, paging (filters in the query
                                        string preset the controls: correct=false, text=..., ...)
    /run/RUN/group?kind=&key=&prompt=   a GRPO group: the n responses of one prompt side by side
    /run/RUN/prompt?prompt=ID|TEXT      one prompt's samples across the iterations
    /run/RUN/tokens?kind=&key=&sample=  one response's tokens coloured by advantage, KL or mismatch
    /run/RUN/rescores[/NAME]            rescores: agreement and the disagreeing samples
    /run/RUN/config                     the resolved config, secrets redacted
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote

from dash import Dash, Input, Output, dcc, html
from dash.development.base_component import Component

from browse.pages import common, config, prompts, rescores, runs, samples, tokens
from browse.queries import Catalog
from verl_core.errors import VerlFlowError

CSS = """
body { font-family: system-ui, sans-serif; margin: 0; color: #222; }
#nav {
  background: #1f2937;
  color: #eee;
  padding: 8px 16px;
  display: flex;
  gap: 16px;
  align-items: baseline;
}
#nav a { color: #9cd3ff; text-decoration: none; }
#nav .brand { font-weight: 600; color: #fff; }
#page { padding: 12px 16px; }
table.plain { border-collapse: collapse; font-size: 13px; }
table.plain th, table.plain td {
  border: 1px solid #ddd;
  padding: 3px 8px;
  text-align: left;
  vertical-align: top;
}
table.plain th { background: #f3f4f6; }
.error { color: #b91c1c; font-weight: 600; }
.filters {
  display: flex;
  flex-wrap: wrap;
  gap: 8px 14px;
  align-items: end;
  margin-bottom: 8px;
  font-size: 13px;
}
.filters .control { display: flex; flex-direction: column; gap: 2px; }
.filters input[type=text], .filters input[type=number] { width: 90px; }
.filters .radios label { margin-right: 8px; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(360px, 1fr)); gap: 8px; }
.group { display: flex; gap: 10px; overflow-x: auto; align-items: flex-start; }
.group-response {
  border: 1px solid #ccc;
  border-radius: 6px;
  padding: 8px;
  min-width: 240px;
  max-width: 360px;
  font-size: 13px;
}
.group-response.correct { border-color: #16a34a; background: #f0fdf4; }
.group-response pre, .response pre {
  white-space: pre-wrap;
  word-break: break-word;
  font-size: 12px;
  background: #f9fafb;
  padding: 4px;
}
.tokens {
  font-family: ui-monospace, monospace;
  font-size: 14px;
  line-height: 1.9;
  white-space: pre-wrap;
  word-break: break-all;
}
.tok { border-radius: 3px; padding: 1px 0; }
.tok.tool { background: #e5e7eb; color: #4b5563; font-style: italic; }
.tok.partial { display: inline-block; min-width: 3px; height: 1.1em; vertical-align: text-bottom; }
.turn { margin: 4px 0; }
.turn-role { font-size: 11px; color: #6b7280; text-transform: uppercase; }
.turn-tool pre { background: #e5e7eb; border-left: 3px solid #9ca3af; font-style: italic; }
.muted { color: #6b7280; font-size: 12px; }
.pager { display: flex; gap: 10px; align-items: center; margin: 6px 0; font-size: 13px; }
"""

Layout = Callable[[Catalog, str, dict[str, str]], Component]
# a run's views: the path segment after /run/RUN → the page's layout(catalog, run_id, query)
VIEWS: dict[str, Layout] = {
    "": runs.run_layout,
    "samples": samples.layout,
    "group": prompts.group_layout,
    "prompt": prompts.history_layout,
    "tokens": tokens.layout,
    "rescores": rescores.layout,
    "config": config.layout,
}


def route(catalog: Catalog, pathname: str | None, search: str | None) -> Component:
    """The page for a URL: ``/`` the runs, ``/run/RUN[/VIEW[/ARG]]`` a run's view."""
    parts = [unquote(p) for p in (pathname or "/").strip("/").split("/") if p]
    query = common.parse_query(search)
    if not parts:
        return runs.layout(catalog)
    if parts[0] != "run" or len(parts) < 2:
        return common.error(f"no page at {pathname}")
    run_id, view = parts[1], parts[2] if len(parts) > 2 else ""
    if view == "rescores" and len(parts) > 3:
        query = {**query, "name": parts[3]}
    page = VIEWS.get(view)
    if page is None:
        return common.error(f"no view {view!r}: one of {', '.join(v for v in VIEWS if v)}")
    if catalog.run_ids is not None and run_id not in catalog.run_ids:
        return common.error(
            f"run {run_id!r} is not one of this browser's runs ({', '.join(catalog.run_ids)})"
        )
    try:
        catalog.store.read_run_record(run_id)
        return page(catalog, run_id, query)
    except (KeyError, ValueError, FileNotFoundError, VerlFlowError) as e:  # an unknown run, set or sample
        return common.error(f"{type(e).__name__}: {e}")


def nav() -> html.Div:
    return html.Div(
        [html.Span("verl-flow browse", className="brand"), dcc.Link("Runs", href="/", id="nav-runs")],
        id="nav",
    )


def create_app(catalog: Catalog) -> Dash:
    """The Dash app over ``catalog``; serve ``app.server`` (a Flask app) to open it."""
    app = Dash(
        __name__,
        title="verl-flow browse",
        update_title=None,  # type: ignore[arg-type]  # None: no "Updating..." title (Dash's documented value)
        suppress_callback_exceptions=True,  # the pages' components exist only while shown
        serve_locally=True,
    )
    app.index_string = app.index_string.replace("{%css%}", "{%css%}<style>" + CSS + "</style>")
    app.layout = html.Div([dcc.Location(id="url"), nav(), html.Div(id="page")])

    @app.callback(Output("page", "children"), Input("url", "pathname"), Input("url", "search"))
    def _page(pathname: str | None, search: str | None) -> Component:
        return route(catalog, pathname, search)

    for page in (runs, samples, tokens, config):
        page.register(app, catalog)
    return app
