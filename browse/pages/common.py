"""What the pages share: URLs of the views, query-string parsing, DataFrame → rows, small tables, the
diverging colour scale of the token view."""

from __future__ import annotations

import math
from typing import Any, cast
from urllib.parse import parse_qs, quote, urlencode

import pandas as pd
from dash import dcc, html

from browse.queries import SampleKind

# One set of a run's samples: (kind, key) as browse.queries.Catalog.sample_sets lists them
SetRef = tuple[str, str]


def run_path(run_id: str, view: str = "") -> str:
    """``/run/{run_id}`` or ``/run/{run_id}/{view}`` (the run id URL-quoted)."""
    base = f"/run/{quote(run_id, safe='')}"
    return f"{base}/{view}" if view else base


def href(run_id: str, view: str, **query: object) -> str:
    """A view's URL with its query string (None values left out)."""
    q = {k: v for k, v in query.items() if v is not None}
    return run_path(run_id, view) + (f"?{urlencode(q)}" if q else "")


def parse_query(search: str | None) -> dict[str, str]:
    """``?a=1&b=x`` → ``{"a": "1", "b": "x"}`` (the last value of a repeated key)."""
    return {k: v[-1] for k, v in parse_qs((search or "").lstrip("?")).items()}


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """DataFrame rows as JSON-able dicts: NaN/NA → None, numpy scalars → Python scalars."""
    out = []
    for row in df.to_dict("records"):
        out.append({k: _plain(v) for k, v in row.items()})
    return out


def _plain(v: Any) -> Any:
    if v is None or v is pd.NA or v is pd.NaT:
        return None
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):  # numpy scalar
        try:
            return _plain(v.item())
        except (ValueError, AttributeError):
            return str(v)
    return v


def fmt(v: Any, digits: int = 4) -> str:
    """A cell's text: floats with ``digits`` significant digits, None/NaN as an en dash."""
    v = _plain(v)
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def table(df: pd.DataFrame, table_id: str, columns: list[str] | None = None) -> html.Table:
    """A plain HTML table of ``df`` (small tables: agreement, config, mismatch list)."""
    cols = columns or list(df.columns)
    head = html.Thead(html.Tr([html.Th(c) for c in cols]))
    body = html.Tbody([html.Tr([html.Td(cell(row.get(c))) for c in cols]) for row in records(df)])
    return html.Table([head, body], id=table_id, className="plain")


def cell(v: Any) -> Any:
    """A table cell: a (text, href) pair becomes a link, anything else its text."""
    if isinstance(v, tuple) and len(v) == 2:
        return dcc.Link(v[0], href=v[1])
    return fmt(v)


def error(text: str) -> html.Div:
    return html.Div(text, id="page-error", className="error")


def colour(value: float | None, scale: float) -> str:
    """A diverging background for ``value`` on ``[-scale, scale]``: blue below 0, red above, alpha
    ``|value| / scale`` (None or NaN: transparent)."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or scale <= 0:
        return "transparent"
    alpha = min(abs(value) / scale, 1.0) * 0.85
    rgb = "214, 39, 40" if value > 0 else "31, 119, 180"
    return f"rgba({rgb}, {alpha:.3f})"


def kind_of(text: str) -> SampleKind:
    """A sample set's kind as a URL gives it; ValueError for anything else (an error page)."""
    if text not in ("train", "val", "eval"):
        raise ValueError(f"no sample kind {text!r}: train, val or eval")
    return cast(SampleKind, text)


def data_attrs(**attrs: object) -> dict[str, Any]:
    """HTML ``data-*`` attributes for a Dash component (``data_attrs(value=1)`` → ``data-value``)."""
    return {f"data-{k.replace('_', '-')}": str(v) for k, v in attrs.items()}
