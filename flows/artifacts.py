"""Prefect artifacts of a pipeline run: a markdown summary (per-iteration metrics, held-out and eval
accuracy, links to the MLflow run and the exported model, where the plots are) and a table of eval
samples; of a rescore, its comparison report. Only called inside a flow run."""

from __future__ import annotations

import re

from flows.results import PipelineResult, RescoreResult
from stages.floor.reports import collect_series, eval_samples, metrics_markdown
from stages.floor.samples import table_artifact
from verl_core.runtime.run import RunContext


def mlflow_run_link(ctx: RunContext) -> str:
    """A link to the MLflow run for an ``http(s)`` server; else how to open it with ``mlflow ui``."""
    if not ctx.tracking_uri or not ctx.mlflow_run_id:
        return "tracking disabled"
    if ctx.tracking_uri.startswith(("http://", "https://")):
        from mlflow.tracking import MlflowClient

        exp = MlflowClient(tracking_uri=ctx.tracking_uri).get_run(ctx.mlflow_run_id).info.experiment_id
        url = f"{ctx.tracking_uri.rstrip('/')}/#/experiments/{exp}/runs/{ctx.mlflow_run_id}"
        return f"[{ctx.mlflow_run_id}]({url})"
    return f"run `{ctx.mlflow_run_id}`: `mlflow ui --backend-store-uri {ctx.tracking_uri}`"


def publish(ctx: RunContext, result: PipelineResult, table_rows: int) -> None:
    """Create the run's markdown and table artifacts from ``result`` (the pipeline's return value)."""
    from prefect.artifacts import create_markdown_artifact

    store = ctx.store()
    stages = result.stages
    lines = [f"# verl-flow run `{ctx.run_id}`", "", f"- artifacts: `{ctx.store_url}/runs/{ctx.run_id}`"]
    lines.append(f"- MLflow: {mlflow_run_link(ctx)}")
    if result.data_snapshot:
        lines.append(f"- data snapshot: `{result.data_snapshot}`")
    if stages.export:
        m = store.read_manifest(stages.export)
        lines.append(f"- exported model: `{store.file_uri(m, 'model/config.json').rsplit('/', 1)[0]}`")
        reg = m.summary.get("registered_model")
        if reg:
            lines.append(f"- registered model: `models:/{reg['name']}/{reg['version']}`")
    ev = result.eval
    if ev is not None:
        pk = f", pass@{ev.k} {ev.pass_at_k:.3f}" if ev.pass_at_k is not None else ""
        lines.append(f"- eval ({ev.prompts} held-out prompts): accuracy {ev.accuracy:.3f}{pk}")
    if stages.report:
        m = store.read_manifest(stages.report)
        lines.append("- plots: " + ", ".join(f"`{store.file_uri(m, p)}`" for p in m.summary["plots"]))
    lines += ["", "## per-iteration metrics", "", metrics_markdown(collect_series(store, ctx.run_id))]
    timing = ", ".join(f"{k} {v:.1f}s" for k, v in result.timing_s.items())
    lines += ["", f"stage wall times: {timing}"]
    create_markdown_artifact("\n".join(lines), key="rlhf-run-summary", description=f"run {ctx.run_id}")
    if stages.eval and table_rows:
        rows = [s._asdict() for s in eval_samples(store, stages.eval, table_rows)]
        table_artifact(rows, key="eval-samples", description="greedy eval samples")


def publish_rescore(ctx: RunContext, result: RescoreResult) -> None:
    """The rescore's markdown report (``rescore/{name}/report/report.md``) as a markdown artifact, keyed
    ``rescore-{name}`` (Prefect keys: lowercase letters, digits and dashes)."""
    from prefect.artifacts import create_markdown_artifact

    store = ctx.store()
    m = store.read_manifest(result.report_uri)
    lines = [
        store.read_bytes(m, "report.md").decode(),
        f"- report: `{result.report_uri}`",
        f"- plot: `{store.file_uri(m, 'plots/accuracy.png')}`",
        f"- MLflow: a child run (tag `verl_flow.rescore` = `{result.name}`) of {mlflow_run_link(ctx)}",
        f"- wall time of this rescore: {result.wall_s:.1f} s",
    ]
    key = "rescore-" + re.sub(r"[^a-z0-9-]+", "-", result.name.lower()).strip("-")
    create_markdown_artifact(
        "\n".join(lines), key=key, description=f"rescore {result.name} of run {ctx.run_id}"
    )
