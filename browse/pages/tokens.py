"""One response token by token (``/run/RUN/tokens?kind=&key=&sample=G:S&colour=advantage``): each
token a span whose background is the chosen value (advantage, KL to the reference, or the mismatch
``behaviour_logprob - trainer_logprob``) on a diverging scale (blue < 0 < red, full colour at the
response's largest magnitude); the span's ``title`` holds every value (shown on hover) and its
``data-value`` the coloured one. Tool-output tokens of a multi-turn response (loss mask 0: the
trainer neither scores nor trains them) are grey and uncoloured (``data-tool="true"``, empty
``data-value``), and the colour scale is the model tokens' alone. A token holding only the first
bytes of a multi-byte character has no text of its own (the character shows on its last token,
:mod:`browse.decode`): a thin coloured box keeps its place and its values. Below it, the set's
samples with the largest mismatch, filled in after the page shows (it reads every sample's
log-probs)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from dash import Dash, Input, Output, State, dcc, html

from browse.pages.common import colour, data_attrs, error, fmt, href, kind_of, records, table
from browse.pages.runs import run_tabs
from browse.queries import Catalog

COLOURS = ("advantage", "kl", "mismatch")


def title(r: dict[str, Any]) -> str:
    """A token's hover text: position, text, id and every per-token value."""
    values = " · ".join(
        f"{k} {fmt(r.get(k), 6)}"
        for k in ("advantage", "kl", "behaviour_logprob", "trainer_logprob", "mismatch")
    )
    if not r.get("model_token", True):
        return f"#{r['position']} {r.get('token')!r} id {r.get('token_id')} · tool output: no loss, no values"
    text = repr(r.get("token")) if r.get("token") else "(bytes of the next token's character)"
    return f"#{r['position']} {text} id {r.get('token_id')} · {values}"


def spans(df: pd.DataFrame, by: str) -> list[html.Span]:
    """The tokens as spans coloured by column ``by``; tool-output tokens grey, not coloured."""
    rows = records(df)
    model = [bool(r.get("model_token", True)) for r in rows]
    vals = [r.get(by) if m else None for r, m in zip(rows, model, strict=True)]
    scale = max((abs(v) for v in vals if v is not None), default=0.0)
    out = []
    for r, v, m in zip(rows, vals, model, strict=True):
        text = r.get("token") or ""
        cls = "tok" if m else "tok tool"
        out.append(
            html.Span(
                text,
                className=cls if text else f"{cls} partial",
                title=title(r),
                style={"background": colour(v, scale)} if m else {},
                **data_attrs(
                    value="" if v is None else repr(float(v)), position=r["position"], tool=str(not m).lower()
                ),
            )
        )
    return out


def mismatch_list(catalog: Catalog, run_id: str, kind: str, key: str) -> list[Any]:
    """The set's samples with the largest mismatch, each linking to its tokens coloured by it."""
    top = catalog.top_mismatch(run_id, kind_of(kind), key)
    if top.empty:
        return [html.Span("no trainer log-probs stored for this set: no mismatch to list", className="muted")]
    top = top.copy()
    top["sample_id"] = [
        (s, href(run_id, "tokens", kind=kind, key=key, sample=s, colour="mismatch")) for s in top["sample_id"]
    ]
    return [html.H4("largest mismatch (behaviour − trainer log-prob)"), table(top, "mismatch-table")]


def layout(catalog: Catalog, run_id: str, query: dict[str, str]) -> html.Div:
    kind, key, sample = query.get("kind"), query.get("key"), query.get("sample")
    if not (kind and key):
        sets = catalog.sample_sets(run_id)
        train = sets[sets["kind"] == "train"] if not sets.empty else sets
        if train.empty:
            return html.Div([run_tabs(run_id), error("no training samples to show tokens of")])
        kind, key = "train", str(train["key"].iloc[-1])
    if not sample:
        first, _ = catalog.samples(run_id, kind_of(kind), key, None, None, 0, 1)
        if first.empty:
            return html.Div([run_tabs(run_id), error(f"no samples in {kind} {key}")])
        sample = str(first["sample_id"].iloc[0])
    by = query.get("colour", "advantage")
    by = by if by in COLOURS else "advantage"
    prompt = query.get("prompt")  # the samples' links carry it
    group = (
        [dcc.Link("its group", href=href(run_id, "group", kind=kind, key=key, prompt=prompt))]
        if prompt
        else []
    )
    toks = catalog.tokens(run_id, kind_of(kind), key, sample)
    return html.Div(
        [
            run_tabs(run_id),
            html.H3(f"{kind} {key} · sample {sample}", id="tokens-title"),
            dcc.Store(id="tokens-ref", data={"run": run_id, "kind": kind, "key": key, "sample": sample}),
            html.Div(
                [
                    html.Label(
                        [
                            "colour by ",
                            dcc.RadioItems(id="tokens-colour", options=list(COLOURS), value=by, inline=True),
                        ]
                    ),
                    *group,
                ],
                className="filters",
            ),
            html.P(
                [
                    "blue < 0 < red, full colour at the response's largest magnitude; hover a token for "
                    "its values; ",
                    html.Span("grey", className="tok tool"),
                    ": tool output (no loss, not coloured)",
                ],
                className="muted",
            ),
            html.Div(spans(toks, by), id="tokens-view", className="tokens"),
            # filled by a callback once the tokens show: it reads every sample's log-probs of the set
            html.Div("finding the samples with the largest mismatch…", id="mismatch-list", className="muted"),
        ]
    )


def register(app: Dash, catalog: Catalog) -> None:
    """The colour choice re-colours the spans (the URL keeps its first choice); the largest-mismatch
    list arrives after the page."""

    @app.callback(
        Output("tokens-view", "children"),
        Input("tokens-colour", "value"),
        State("tokens-ref", "data"),
        prevent_initial_call=True,
    )
    def _recolour(by: str, ref: dict[str, str]) -> list[html.Span]:
        toks = catalog.tokens(ref["run"], kind_of(ref["kind"]), ref["key"], ref["sample"])
        return spans(toks, by)

    @app.callback(
        Output("mismatch-list", "children"), Output("mismatch-list", "className"), Input("tokens-ref", "data")
    )
    def _mismatch(ref: dict[str, str]) -> tuple[list[Any], str]:
        return mismatch_list(catalog, ref["run"], ref["kind"], ref["key"]), ""
