"""Prefect artifacts of a pipeline run: a markdown summary (per-iteration metrics, held-out and eval
accuracy, links to the MLflow run and the exported model, the plots) and a table of eval samples; of
a rescore, its comparison report. Only called inside a flow run.

What Prefect's UI (3.8) does with them, checked in Chromium by ``tests/flows/test_prefect_ui_browser.py``:
it renders markdown artifacts and every cell of a table artifact as markdown, HTML included, and
loads ``data:`` image URIs, not ``file://`` ones (a page served over http). So the plots are inlined
as PNG data URIs (:func:`image_markdown`), and sample texts are escaped (:func:`markdown_cell`): a
response's ``#### 42`` stays text, not a heading, and its lines stay on one wrapped line.

Paths are shown relative to the run's directory (:func:`in_run`): the default store is ``./runs``
and holds each run under ``runs/{run_id}``, so a full path reads ``.../runs/runs/{run_id}/...``; the
summary names the store once, then the run's files in it. The store's layout stays as it is:
existing runs are found where they are.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from browse.record import browser_url
from flows.results import PipelineResult, RescoreResult
from flows.run_links import mlflow_run_page
from stages.floor.artifacts import load_tokenizer
from stages.floor.reports import collect_series, eval_samples, metrics_markdown
from stages.floor.samples import markdown_cell, table_artifact
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore, Manifest


def mlflow_run_link(ctx: RunContext) -> str:
    """A link to the MLflow run for an ``http(s)`` server; else how to open it with ``mlflow ui``."""
    if not ctx.tracking_uri or not ctx.mlflow_run_id:
        return "tracking disabled"
    if ctx.tracking_uri.startswith(("http://", "https://")):
        from mlflow.tracking import MlflowClient

        exp = MlflowClient(tracking_uri=ctx.tracking_uri).get_run(ctx.mlflow_run_id).info.experiment_id
        return f"[{ctx.mlflow_run_id}]({mlflow_run_page(ctx.tracking_uri, exp, ctx.mlflow_run_id)})"
    return f"run `{ctx.mlflow_run_id}`: `mlflow ui --backend-store-uri {ctx.tracking_uri}`"


MAX_INLINE_PNG_BYTES = 1 << 20  # a larger plot is named (its path in the run), not inlined

# CommonMark lets every ASCII punctuation character be escaped with a backslash
_MARK = "\x00verl-flow-user-text\x00"


def user_text(tokenizer: Any, prompt_text: str) -> str:
    """The user message of a single-turn ``prompt_text`` rendered by ``tokenizer``'s chat template
    (the generation prompt added): the template's text around one user message is cut off. Any other
    prompt (a system message of its own, tools, several turns) is returned whole."""
    try:
        shown = tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # no chat template (a base model's plain prompts)
        return prompt_text
    head, _, tail = str(shown).partition(_MARK)
    if (
        len(prompt_text) >= len(head) + len(tail)
        and prompt_text.startswith(head)
        and prompt_text.endswith(tail)
    ):
        return prompt_text[len(head) : len(prompt_text) - len(tail)]
    return prompt_text


def in_run(store: ArtifactStore, run_id: str, uri: str) -> str:
    """``uri`` (a file of run ``run_id``) relative to the run's directory, as the summary shows it."""
    run_dir = store.uri(store.run_dir(run_id)).rstrip("/") + "/"
    return uri[len(run_dir) :] if uri.startswith(run_dir) else uri


def image_markdown(store: ArtifactStore, manifest: Manifest, name: str, run_id: str) -> str:
    """The PNG ``name`` of ``manifest`` as a markdown image with a ``data:`` URI (the UI loads no
    ``file://`` URL), captioned with its path in the run."""
    where = in_run(store, run_id, store.file_uri(manifest, name))
    data = store.read_bytes(manifest, name)
    if len(data) > MAX_INLINE_PNG_BYTES:
        return f"- `{where}` ({len(data) >> 10} KiB, not inlined)"
    title = name.rsplit("/", 1)[-1].removesuffix(".png")
    return f"![{title}](data:image/png;base64,{base64.b64encode(data).decode()})\n\n`{where}`"


def sample_rows(
    store: ArtifactStore, template_pack_uri: str | None, eval_uri: str, limit: int
) -> list[dict[str, Any]]:
    """The eval-samples table: the prompt's user message (not the chat template around it), every
    text escaped for the UI's markdown."""
    tokenizer = load_tokenizer(store, template_pack_uri) if template_pack_uri else None
    rows = []
    for s in eval_samples(store, eval_uri, limit):
        row = s._asdict()
        if tokenizer is not None:
            row["prompt"] = user_text(tokenizer, s.prompt)
        rows.append({k: markdown_cell(v) if isinstance(v, str) else v for k, v in row.items()})
    return rows


def publish(ctx: RunContext, result: PipelineResult, table_rows: int) -> None:
    """Create the run's markdown and table artifacts from ``result`` (the pipeline's return value)."""
    from prefect.artifacts import create_markdown_artifact

    store = ctx.store()
    stages = result.stages
    run_dir = f"runs/{ctx.run_id}"
    lines = [
        f"# verl-flow run `{ctx.run_id}`",
        "",
        f"- store: `{ctx.store_url}`, this run's files under `{run_dir}`",
    ]
    lines.append(f"- MLflow: {mlflow_run_link(ctx)}")
    if result.data_snapshot:
        lines.append(f"- data snapshot: `{result.data_snapshot}`")
    if stages.export:
        m = store.read_manifest(stages.export)
        model_dir = in_run(store, ctx.run_id, store.file_uri(m, "model/config.json").rsplit("/", 1)[0])
        lines.append(f"- exported model: `{model_dir}`")
        reg = m.summary.get("registered_model")
        if reg:
            lines.append(f"- registered model: `models:/{reg['name']}/{reg['version']}`")
    ev = result.eval
    if ev is not None:
        pk = f", pass@{ev.k} {ev.pass_at_k:.3f}" if ev.pass_at_k is not None else ""
        lines.append(f"- eval ({ev.prompts} held-out prompts): accuracy {ev.accuracy:.3f}{pk}")
    lines += ["", "## per-iteration metrics", "", metrics_markdown(collect_series(store, ctx.run_id))]
    timing = ", ".join(f"{k} {v:.1f}s" for k, v in result.timing_s.items())
    lines += ["", f"stage wall times: {timing}"]
    if stages.report:
        m = store.read_manifest(stages.report)
        lines += ["", "## plots", ""]
        lines += [image_markdown(store, m, p, ctx.run_id) + "\n" for p in m.summary["plots"]]
    create_markdown_artifact("\n".join(lines), key="rlhf-run-summary", description=f"run {ctx.run_id}")
    browser = browser_url(store.url, ctx.run_id)  # a `verl-flow browse` open on this store
    if browser is not None:
        from prefect.artifacts import create_link_artifact

        create_link_artifact(
            browser, link_text=f"run {ctx.run_id} in the rollout browser", key="rollout-browser"
        )
    if stages.eval and table_rows:
        rows = sample_rows(store, stages.template_pack, stages.eval, table_rows)
        table_artifact(rows, key="eval-samples", description="greedy eval samples")


def publish_rescore(ctx: RunContext, result: RescoreResult) -> None:
    """The rescore's markdown report (``rescore/{name}/report/report.md``) as a markdown artifact, keyed
    ``rescore-{name}`` (Prefect keys: lowercase letters, digits and dashes)."""
    from prefect.artifacts import create_markdown_artifact

    store = ctx.store()
    m = store.read_manifest(result.report_uri)
    lines = [
        store.read_bytes(m, "report.md").decode(),
        f"- report: `{in_run(store, ctx.run_id, result.report_uri)}` in the run's directory",
        image_markdown(store, m, "plots/accuracy.png", ctx.run_id),
        f"- MLflow: a child run (tag `verl_flow.rescore` = `{result.name}`) of {mlflow_run_link(ctx)}",
        f"- wall time of this rescore: {result.wall_s:.1f} s",
    ]
    key = "rescore-" + re.sub(r"[^a-z0-9-]+", "-", result.name.lower()).strip("-")
    create_markdown_artifact(
        "\n".join(lines), key=key, description=f"rescore {result.name} of run {ctx.run_id}"
    )
