"""One prompt's samples: its GRPO/RLOO group in one set, side by side (``/run/RUN/group?kind=&key=
&prompt=ID``), and its samples across the run's iterations (``/run/RUN/prompt?prompt=ID|TEXT``).

A multi-turn response shows its turns in order (:mod:`browse.turns`): the model's turns as text, each
tool turn grey with the calls it answers (``name(arguments) → result``); the response text alone is
only the last model turn."""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go
from dash import dcc, html

from browse.pages.common import data_attrs, error, fmt, href, kind_of, records, run_path
from browse.pages.runs import run_tabs
from browse.queries import Catalog
from browse.turns import sample_turns


def _turn(i: int, t: dict[str, Any]) -> html.Div:
    """One turn of a multi-turn response: a model turn's text, or a tool turn with its calls."""
    calls = [
        html.Div(
            f"{c.get('name')}({c.get('arguments')}) → {c.get('error') or c.get('result')}",
            className="turn-call",
        )
        for c in t.get("calls") or []
    ]
    tool = t.get("role") == "tool"
    return html.Div(
        [
            html.Span("tool output" if tool else "model", className="turn-role"),
            *calls,
            html.Pre(t.get("text")),
        ],
        className="turn turn-tool" if tool else "turn turn-model",
        **data_attrs(role=t.get("role"), index=i),
    )


def _with_tools(rows: list[dict[str, Any]]) -> list[str]:
    """The samples whose turns to read: those with a tool call (a tool turn answers one)."""
    return [str(r["sample_id"]) for r in rows if r.get("tool_calls")]


def _response(r: dict[str, Any], turns: list[dict[str, Any]]) -> Any:
    """The response: its turns when a tool turn is among them, else its text."""
    if any(t.get("role") == "tool" for t in turns):
        return html.Div([_turn(i, t) for i, t in enumerate(turns)], className="turns")
    return html.Pre(r.get("response") or "")


def _card(run_id: str, kind: str, key: str, r: dict[str, Any], turns: list[dict[str, Any]]) -> html.Div:
    """One response of a group: reward, advantage, length, extracted answer against the truth."""
    ok = bool(r.get("correct"))
    facts = [
        ("reward", fmt(r.get("reward"))),
        ("advantage", fmt(r.get("advantage"))),
        ("length", fmt(r.get("response_length"))),
        ("finish", fmt(r.get("finish_reason"))),
        ("tools", fmt(r.get("tool_calls"))),
        ("extracted", fmt(r.get("extracted_answer"))),
        ("truth", fmt(r.get("ground_truth"))),
    ]
    if r.get("garbled"):
        facts.append(("garbled", r.get("garbled_reason") or "yes"))
    rows = [html.Tr([html.Th(k), html.Td(v, className=f"fact-{k}")]) for k, v in facts]
    title = f"sample {r.get('sample_index')}" + (" (baseline)" if r.get("is_baseline") else "")
    return html.Div(
        [
            html.B(title),
            " ",
            html.Span("✓ correct" if ok else "✗ wrong", style={"color": "#16a34a" if ok else "#b91c1c"}),
            html.Table(rows, className="plain"),
            _response(r, turns),
            dcc.Link(
                "tokens",
                href=href(
                    run_id, "tokens", kind=kind, key=key, sample=r.get("sample_id"), prompt=r.get("prompt_id")
                ),
            ),
        ],
        className="group-response correct" if ok else "group-response",
        id=f"group-response-{r.get('sample_index')}",
        **data_attrs(sample_id=r.get("sample_id")),
    )


def group_layout(catalog: Catalog, run_id: str, query: dict[str, str]) -> html.Div:
    kind, key, prompt = query.get("kind"), query.get("key"), query.get("prompt")
    if not (kind and key and prompt):
        return html.Div([run_tabs(run_id), error("a group needs kind, key and prompt in the URL")])
    df = catalog.group(run_id, kind_of(kind), key, int(prompt))
    if df.empty:
        return html.Div([run_tabs(run_id), error(f"no samples of prompt {prompt} in {kind} {key}")])
    rows = records(df)
    first = rows[0]
    turns = sample_turns(catalog, run_id, kind, key, _with_tools(rows))
    rewards = [float(r["reward"]) for r in rows if r.get("reward") is not None]
    spread = f"mean reward {fmt(sum(rewards) / len(rewards))}" if rewards else ""
    return html.Div(
        [
            run_tabs(run_id),
            html.H3(f"{kind} {key} · prompt {prompt} · {len(rows)} responses · {spread}"),
            html.Div(
                [
                    html.B("prompt "),
                    dcc.Link("(across iterations)", href=href(run_id, "prompt", prompt=prompt)),
                    html.Pre(first.get("prompt") or "", id="group-prompt"),
                    html.Span(f"ground truth: {fmt(first.get('ground_truth'))}", className="muted"),
                ],
                className="response",
            ),
            html.Div(
                [_card(run_id, kind, key, r, turns.get(str(r["sample_id"]), [])) for r in rows],
                className="group",
                id="group-responses",
            ),
        ]
    )


def _history_chart(df: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(x=df["iteration"], y=df["reward"], mode="markers", name="reward per sample", opacity=0.6)
    )
    mean = df.groupby("iteration")["reward"].mean()
    fig.add_trace(go.Scatter(x=mean.index, y=mean.values, mode="lines+markers", name="group mean"))
    fig.update_layout(
        height=230, margin={"l": 40, "r": 10, "t": 20, "b": 30}, xaxis={"title": "iteration", "dtick": 1}
    )
    return fig


def history_layout(catalog: Catalog, run_id: str, query: dict[str, str]) -> html.Div:
    prompt = query.get("prompt", "")
    form = html.Form(
        [
            html.Div(
                [html.Span("prompt id or text"), dcc.Input(id="prompt-query", name="prompt", value=prompt)],
                className="control",
            ),
            html.Button("show", type="submit"),
        ],
        action=run_path(run_id, "prompt"),
        method="get",
        className="filters",
    )
    if not prompt:
        return html.Div(
            [run_tabs(run_id), form, html.P("Give a prompt id or a piece of its text.", className="muted")]
        )
    df = catalog.prompt_history(run_id, int(prompt) if prompt.isdigit() else prompt)
    if df.empty:
        return html.Div([run_tabs(run_id), form, error(f"no training samples of prompt {prompt!r}")])
    blocks: list[Any] = []
    for iteration, part in df.groupby("iteration", sort=True):
        rows = records(part)
        key = f"iter-{int(iteration):04d}"
        turns = sample_turns(catalog, run_id, "train", key, _with_tools(rows))
        link = dcc.Link(
            f"iteration {iteration}",
            href=href(run_id, "group", kind="train", key=key, prompt=rows[0].get("prompt_id")),
        )
        cells = [
            html.Div(
                [
                    html.Span(
                        f"reward {fmt(r.get('reward'))} · {'✓' if r.get('correct') else '✗'} · "
                        f"len {fmt(r.get('response_length'))}"
                    ),
                    _response(r, turns.get(str(r["sample_id"]), [])),
                ],
                className="group-response correct" if r.get("correct") else "group-response",
            )
            for r in rows
        ]
        blocks.append(
            html.Div([html.H4(link), html.Div(cells, className="group")], className="history-iteration")
        )
    prompts = df["prompt_id"].unique().tolist()
    return html.Div(
        [
            run_tabs(run_id),
            form,
            html.Pre(str(df["prompt"].iloc[0]), id="history-prompt"),
            html.P(
                f"prompt ids {prompts}; {len(df)} samples over {df['iteration'].nunique()} iterations",
                className="muted",
            ),
            dcc.Graph(figure=_history_chart(df), config={"displayModeBar": False}, id="history-chart"),
            html.Div(blocks, id="prompt-history"),
        ]
    )
