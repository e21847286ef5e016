"""The commands on a run's policy: ``export`` (a merged HF model dir, registered in MLflow) and
``eval`` (held-out accuracy and pass@k of a checkpoint, an export, a model dir or a served model)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from flows.cli.common import RunIdArg, StoreOpt, fail, out, print_table
from stages.floor.locations import list_exports, template_pack_uri
from verl_core.config import StoreConfig
from verl_core.errors import ConfigError, VerlFlowError

if TYPE_CHECKING:
    from stages.floor.reports import EvalReport, EvalSample


IterationOpt = Annotated[
    int | None,
    typer.Option(
        "--iteration", help="RL iteration of the checkpoint (default: the latest; 0: the SFT policy)"
    ),
]


def export_cmd(
    run_id: RunIdArg,
    iteration: IterationOpt = None,
    to: Annotated[
        str | None, typer.Option("--to", help="Also copy the model dir here (a new directory or a URI)")
    ] = None,
    store: StoreOpt = None,
) -> None:
    """Merge a policy checkpoint of RUN_ID (LoRA merged) into an HF model dir and register it in MLflow."""
    from verl_core.runtime.env import set_quiet_env

    set_quiet_env()
    from flows.runs import attach_run
    from stages.export import export_model
    from stages.floor.artifacts import copy_export

    try:
        ctx, cfg = attach_run(store or StoreConfig().url, run_id)
        st = ctx.store()
        uri = export_model.fn(ctx, cfg, template_pack_uri(st, run_id), iteration)
        manifest = st.read_manifest(uri)
        dest = copy_export(st, manifest, to) if to else None
    except ConfigError as e:
        fail(e, 2)
    except VerlFlowError as e:
        fail(e, 1)
    out.print(f"exported {manifest.summary['source']} of run {run_id}: {uri}")
    reg = manifest.summary.get("registered_model")
    if reg:
        out.print(f"registered in MLflow as {reg['name']} version {reg['version']} ({reg['source']})")
    if dest:
        out.print(f"model directory: {dest}")


def eval_cmd(
    run_id: RunIdArg,
    overrides: Annotated[
        list[str] | None, typer.Argument(help="eval settings, e.g. eval.k=8 eval.max_samples=200")
    ] = None,
    iteration: IterationOpt = None,
    model: Annotated[
        str | None, typer.Option("--model", help="An exported HF model directory instead of the run's policy")
    ] = None,
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--endpoint",
            help="An OpenAI-compatible server (e.g. verl-flow serve's http://127.0.0.1:8000) serving a "
            "model with the run's tokenizer, instead of the run's policy",
        ),
    ] = None,
    served_model: Annotated[
        str | None, typer.Option("--served-model", help="Model name at --endpoint (default: its first)")
    ] = None,
    store: StoreOpt = None,
) -> None:
    """Evaluate a policy of RUN_ID on its held-out prompts: greedy accuracy, pass@k, per data source.
    Default policy: the run's latest export, else its latest checkpoint."""
    from verl_core.runtime.env import set_quiet_env

    set_quiet_env()
    from flows.runs import attach_run
    from stages.eval import evaluate
    from stages.floor.artifacts import dir_source, endpoint_source, export_source, in_run_source
    from stages.floor.reports import eval_samples, read_eval_report
    from verl_core.config import with_overrides

    try:
        ctx, cfg = attach_run(store or StoreConfig().url, run_id)
        cfg = with_overrides(cfg, overrides or [])
        st = ctx.store()
        tp_uri = template_pack_uri(st, run_id)
        exports = list_exports(st, run_id)
        if model and endpoint:
            raise ConfigError("--model and --endpoint: give one policy to evaluate")
        if endpoint:
            source = endpoint_source(endpoint, served_model)
        elif model:
            source = dir_source(model)
        elif iteration is None and exports:
            source = export_source(st, st.manifest_uri(run_id, exports[-1]))
        else:
            source = in_run_source(st, run_id, iteration)
        uri = evaluate.fn(ctx, cfg, tp_uri, source)
        report = read_eval_report(st, uri)
        samples = eval_samples(st, uri, 3)
    except ConfigError as e:
        fail(e, 2)
    except VerlFlowError as e:
        fail(e, 1)
    _print_eval(source.label, report, samples)
    out.print(f"samples and report: {uri}")


def _print_eval(label: str, report: EvalReport, samples: list[EvalSample]) -> None:
    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    k = report.k
    table = Table("data source", "prompts", "accuracy (greedy)", f"pass@{k}", title=f"eval of {label}")
    for source, a in report.by_source.items():
        table.add_row(source, str(a.prompts), f"{a.accuracy:.3f}", cell(a.pass_at_k))
    table.add_row("all", str(report.prompts), f"{report.accuracy:.3f}", cell(report.pass_at_k))
    print_table(table)
    for row in samples:
        mark = "✓" if row.correct else "✗"
        out.print(f"{mark} {row.response!r} (answer {row.extracted!r}, expected {row.ground_truth!r})")
