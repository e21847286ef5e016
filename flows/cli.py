"""``verl-flow``: run the pipeline, show resolved configs, list and inspect runs.

Heavy modules (Prefect, torch, MLflow) are imported only by the commands that need them.
Errors that are the user's to fix (bad config, missing artifact) print one line and exit 2
(config) or 1 (anything else), without a traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from verl_core.config import StoreConfig, VerlFlowConfig, load_config, to_yaml
from verl_core.errors import ConfigError, VerlFlowError
from verl_core.store import ArtifactStore

app = typer.Typer(
    name="verl-flow",
    help="RL post-training (SFT, PPO, GRPO) as a Prefect pipeline of stages with Parquet artifacts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect configurations.", no_args_is_help=True)
runs_app = typer.Typer(help="Inspect runs in an artifact store.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(runs_app, name="runs")

out = Console()
err = Console(stderr=True)

ConfigArg = Annotated[str, typer.Argument(help="YAML config file (e.g. configs/quickstart.yaml)")]
OverridesArg = Annotated[
    list[str] | None, typer.Argument(help="Dotted overrides, e.g. actor.lr=1e-6 rollout.n=8")
]
StoreOpt = Annotated[
    str | None,
    typer.Option("--store", help="Artifact store URL (default: the config default, ./runs)"),
]


def _fail(exc: Exception, code: int) -> NoReturn:
    err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _load(config: str, overrides: list[str] | None) -> VerlFlowConfig:
    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        _fail(e, 2)


@app.command()
def run(
    config: ConfigArg,
    overrides: OverridesArg = None,
    run_id: Annotated[
        str | None,
        typer.Option("--run-id", help="Run id (default: experiment name + config hash; reruns resume)"),
    ] = None,
) -> None:
    """Run the pipeline for CONFIG with OVERRIDES (the config is validated before any work)."""
    cfg = _load(config, overrides)
    from verl_core.env import set_quiet_env

    set_quiet_env()
    from flows.pipeline import rlhf_pipeline

    try:
        result = rlhf_pipeline(config=cfg, run_id=run_id)
    except ConfigError as e:
        _fail(e, 2)
    except VerlFlowError as e:
        _fail(e, 1)
    _print_result(result)


def _print_result(result: dict[str, Any]) -> None:
    """The summary a quickstart ends with: stages, validation accuracy before/after RL, wall times."""
    stages = Table("stage", "manifest", "seconds", title=f"run {result['run_id']}")
    for name, uri in result["stages"].items():
        stages.add_row(name, uri, f"{result['timing_s'].get(name, 0.0):.1f}")
    out.print(stages)
    acc = result.get("val_accuracy") or {}
    if acc:
        first, last = min(acc, key=int), max(acc, key=int)
        table = Table("validation", "iteration", "accuracy", title="held-out accuracy (greedy)")
        table.add_row("SFT checkpoint" if int(first) == 0 else "first", first, f"{acc[first]:.3f}")
        table.add_row("after RL", last, f"{acc[last]:.3f}")
        table.add_row("change", "", f"{acc[last] - acc[first]:+.3f}")
        out.print(table)
    rl_times = {k[3:]: v for k, v in result["timing_s"].items() if k.startswith("rl/")}
    if rl_times:
        times = Table("RL phase", "seconds", title="time inside the RL loop")
        for k, v in rl_times.items():
            times.add_row(k, f"{v:.1f}")
        out.print(times)


@config_app.command("show")
def config_show(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Print the resolved config (YAML) and its hash."""
    cfg = _load(config, overrides)
    sys.stdout.write(to_yaml(cfg))
    sys.stdout.write(f"# config_hash: {cfg.config_hash()}\n")


@runs_app.command("list")
def runs_list(store: StoreOpt = None) -> None:
    """List the runs in the store: id, experiment, created, updated, stages committed."""
    st = _store(store)
    table = Table("run_id", "experiment", "created", "updated", "stages", "config_hash")
    try:
        for run_id in st.list_runs():
            rec = st.read_run_record(run_id)
            n = len(st.list_manifests(run_id))
            exp = rec.config.get("trainer", {}).get("experiment_name", "")
            table.add_row(run_id, exp, rec.created_at[:19], rec.updated_at[:19], str(n), rec.config_hash[:12])
    except VerlFlowError as e:
        _fail(e, 1)
    out.print(table)


@runs_app.command("show")
def runs_show(run_id: Annotated[str, typer.Argument(help="Run id")], store: StoreOpt = None) -> None:
    """Stages committed in RUN_ID and their artifacts with row counts and sizes."""
    st = _store(store)
    try:
        rec = st.read_run_record(run_id)
        manifests = st.list_manifests(run_id)
    except VerlFlowError as e:
        _fail(e, 1)
    out.print(f"run [bold]{run_id}[/] in {st.url}  config {rec.config_hash[:12]}  code {rec.code_version}")
    table = Table("stage", "artifact", "kind", "rows", "size", "committed")
    for m in manifests:
        for i, f in enumerate(m.files):
            table.add_row(
                m.stage if i == 0 else "",
                f.name,
                f.kind or "-",
                "-" if f.rows is None else str(f.rows),
                _human(f.size),
                m.producer.created_at[:19] if i == 0 else "",
            )
    out.print(table)


def _store(url: str | None) -> ArtifactStore:
    return ArtifactStore(url or StoreConfig().url)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def main() -> None:
    app()


if __name__ == "__main__":
    main()
