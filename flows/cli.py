"""``verl-flow``: run the pipeline, show resolved configs, list and inspect runs.

Heavy modules (Prefect, torch, MLflow) are imported only by the commands that need them.
Errors that are the user's to fix (bad config, missing artifact) print one line and exit 2
(config) or 1 (anything else), without a traceback. A failed ``run`` prints one line too (stage,
iteration, what failed, the log file; ``flows.run_log``), the traceback goes to the log file.
"""

from __future__ import annotations

import json
import shlex
import sys
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flows.doctor import doctor
from stages.floor.locations import REPORT, list_exports, template_pack_uri
from stages.floor.parent import (
    FamilyTree,
    RunLink,
    family_tree,
    parent_overrides,
    parse_parent_spec,
    read_family,
)
from stages.floor.rescore import RescoreListing, is_rescore, list_rescores
from verl_core.config import StoreConfig, VerlFlowConfig, load_config, to_yaml
from verl_core.errors import ConfigError, VerlFlowError
from verl_core.runtime.launch import FOLLOWER_JOB_URI, LaunchSpec, torchrun_command
from verl_core.store import ArtifactStore

if TYPE_CHECKING:
    from collections.abc import Callable

    from flows.results import PipelineResult, RescoreResult
    from stages.floor.reports import EvalReport, EvalSample
    from verl_core.runtime.serving import ServeConfig

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
app.command("doctor")(doctor)  # flows/doctor.py: versions, pins, store and MLflow reachable

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


def _fail(exc: Exception | str, code: int, *, one_line: bool = True) -> NoReturn:
    """Print the error and exit with ``code``: one line, or (``one_line=False``) one line per line of
    the message, each its own problem (a config can have several, see verl_core.config.preflight)."""
    text = str(exc)
    lines = [" ".join(text.split("\n"))] if one_line else text.splitlines()
    for line in lines:
        err.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _load(config: str, overrides: list[str] | None) -> VerlFlowConfig:
    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        _fail(e, 2, one_line=False)


@app.command()
def run(
    config: ConfigArg,
    overrides: OverridesArg = None,
    run_id: Annotated[
        str | None,
        typer.Option("--run-id", help="Run id (default: experiment name + config hash; reruns resume)"),
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Also show Prefect's failure lines and tracebacks")
    ] = False,
    fork: Annotated[
        str | None,
        typer.Option(
            "--fork",
            help="RUN_ID@ITER: start from that run's checkpoint ckpt/iter-ITER (same store) with this "
            "config (parent.run_id, parent.iteration)",
        ),
    ] = None,
) -> None:
    """Run the pipeline for CONFIG with OVERRIDES (the config is validated before any work).
    The full log goes to a file (logs/RUN_ID/ beside runs/ in a local store); a failure prints one line."""
    if fork is not None:
        try:
            overrides = [*(overrides or []), *parent_overrides(*parse_parent_spec(fork))]
        except ConfigError as e:
            _fail(e, 2)
    cfg = _load(config, overrides)
    if cfg.parent is not None:  # the parent's checkpoint (and a replay's data): one line, before any work
        from stages.floor.parent import check_parent
        from verl_core.runtime.run import default_run_id

        try:
            check_parent(_store(cfg.store.url), cfg, run_id or default_run_id(cfg))
        except VerlFlowError as e:
            _fail(e, 1)

    def pipeline() -> PipelineResult:
        from flows.pipeline import rlhf_pipeline

        return rlhf_pipeline(config=cfg, run_id=run_id)

    _run_logged(cfg, run_id, verbose, pipeline)


def _run_logged(
    cfg: VerlFlowConfig, run_id: str | None, verbose: bool, call: Callable[[], PipelineResult]
) -> None:
    """Run a pipeline flow (``call``) from the command line: Prefect quiet and its API checked first,
    the full log to the run's log file, a failure printed as one line (exit 2 for a config error)."""
    from verl_core.runtime.env import set_quiet_env

    set_quiet_env()
    from flows.prefect_api import check_api
    from flows.run_log import RunLog, log_path

    try:
        check_api()
    except VerlFlowError as e:
        _fail(e, 1)
    log = RunLog(log_path(cfg, run_id), verbose)
    try:
        result = call()
    except Exception as e:
        _fail(log.failure_line(e), 2 if isinstance(e, ConfigError) else 1)
    finally:
        log.close()
    _print_result(result)
    out.print(f"full log: {log.path}", highlight=False, soft_wrap=True)


def _print_result(result: PipelineResult) -> None:
    """The summary a quickstart ends with: stages, validation accuracy before/after RL, wall times."""
    stages = Table("stage", "manifest", "seconds", title=f"run {result.run_id}")
    for name, uri in result.stages.ran().items():
        stages.add_row(name, uri, f"{result.timing_s.get(name, 0.0):.1f}")
    _print_table(stages)
    acc = result.val_accuracy
    if acc:
        first, last = min(acc), max(acc)
        table = Table("validation", "iteration", "accuracy", title="held-out accuracy (greedy)")
        table.add_row("SFT checkpoint" if first == 0 else "first", str(first), f"{acc[first]:.3f}")
        table.add_row("after RL", str(last), f"{acc[last]:.3f}")
        table.add_row("change", "", f"{acc[last] - acc[first]:+.3f}")
        _print_table(table)
    if result.rl_timing_s:
        times = Table("RL phase", "seconds", title="time inside the RL loop")
        for phase, seconds in result.rl_timing_s.items():
            times.add_row(phase, f"{seconds:.1f}")
        _print_table(times)


@config_app.command("show")
def config_show(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Print the resolved config (YAML) and its hash."""
    cfg = _load(config, overrides)
    sys.stdout.write(to_yaml(cfg))
    sys.stdout.write(f"# config_hash: {cfg.config_hash()}\n")


@app.command("spmd-command")
def spmd_command(
    overrides: OverridesArg = None,
    config: Annotated[
        str | None, typer.Option("--config", help="YAML config (default: the schema's defaults)")
    ] = None,
    job: Annotated[
        str, typer.Option("--job", help="Job URI (default: a follower's, the spec comes from node 0)")
    ] = FOLLOWER_JOB_URI,
) -> None:
    """Print the torchrun command of the config's SPMD jobs (trainer.nnodes, n_gpus_per_node,
    rdzv_endpoint, rdzv_id): what node 0 runs for a job, and what spmd-follow runs on the others."""
    from flows.follow import launch_spec

    try:
        spec = launch_spec(_load_optional(config, overrides))
    except ValueError as e:
        _fail(e, 2)
    sys.stdout.write(shlex.join(torchrun_command(spec, job)) + "\n")


def _load_optional(config: str | None, overrides: list[str] | None) -> VerlFlowConfig:
    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        _fail(e, 2, one_line=False)


@app.command("spmd-follow")
def spmd_follow(
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Nodes of the job (trainer.nnodes)")],
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", min=1, help="Processes per node (trainer.n_gpus_per_node)")
    ],
    rdzv_endpoint: Annotated[
        str, typer.Option("--rdzv-endpoint", help="HOST:PORT of node 0 (trainer.rdzv_endpoint)")
    ],
    rdzv_id: Annotated[
        str | None, typer.Option("--rdzv-id", help="Rendezvous id (trainer.rdzv_id; default: its default)")
    ] = None,
    max_jobs: Annotated[
        int | None,
        typer.Option("--max-jobs", min=1, help="Stop after this many jobs (default: the final)"),
    ] = None,
    wait_s: Annotated[
        float, typer.Option("--wait-s", help="Seconds to keep trying for the next job before failing")
    ] = 3600.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the torchrun command and exit")] = False,
) -> None:
    """Run a follower node (1..N−1) of a multi-node run: node 0's SPMD jobs, one torchrun each, until
    the final one. A failed job prints one line (job, stage, exit code) and exits 1."""
    from verl_core.config.schema import TrainerConfig

    try:
        spec = LaunchSpec(
            nnodes=nnodes,
            nproc_per_node=nproc_per_node,
            rdzv_id=rdzv_id or TrainerConfig.model_fields["rdzv_id"].default,
            rdzv_endpoint=rdzv_endpoint,
        )
    except ValueError as e:
        _fail(e, 2)
    if dry_run:
        sys.stdout.write(shlex.join(torchrun_command(spec, FOLLOWER_JOB_URI)) + "\n")
        return
    from flows.follow import FollowError, follow

    try:
        result = follow(spec, max_jobs=max_jobs, wait_s=wait_s, log=out.print)
    except FollowError as e:
        _fail(e, 1)
    out.print(f"followed {len(result.jobs)} SPMD job(s): {', '.join(j.stage for j in result.jobs)}")


JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")]


@runs_app.command("list")
def runs_list(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """List the runs in the store: id, experiment, created, updated, stages committed."""
    st = _store(store)
    rows = []
    try:
        for run_id in st.list_runs():
            rec = st.read_run_record(run_id)
            rows.append(
                {
                    "run_id": run_id,
                    "experiment": rec.config.get("trainer", {}).get("experiment_name", ""),
                    "created_at": rec.created_at,
                    "updated_at": rec.updated_at,
                    "stages": len(st.list_manifests(run_id)),
                    "config_hash": rec.config_hash,
                }
            )
    except VerlFlowError as e:
        _fail(e, 1)
    if as_json:
        _print_json(rows)
        return
    table = Table("run_id", "experiment", "created", "updated", "stages", "config_hash")
    for r in rows:
        table.add_row(
            r["run_id"], r["experiment"], r["created_at"][:19], r["updated_at"][:19], str(r["stages"]),
            r["config_hash"][:12],
        )  # fmt: skip
    _print_table(table)


@runs_app.command("show")
def runs_show(
    run_id: Annotated[str, typer.Argument(help="Run id")], store: StoreOpt = None, as_json: JsonOpt = False
) -> None:
    """Stages committed in RUN_ID and their artifacts with row counts and sizes."""
    st = _store(store)
    try:
        rec = st.read_run_record(run_id)
        manifests = st.list_manifests(run_id)
    except VerlFlowError as e:
        _fail(e, 1)
    report = next((m for m in manifests if m.stage == REPORT), None)
    rescores = list_rescores(manifests)
    family = family_tree(read_family(st), run_id)
    if as_json:
        stages = [
            {
                "stage": m.stage,
                "committed": m.producer.created_at,
                "manifest": st.manifest_uri(run_id, m.stage),
                "files": [
                    {
                        "name": f.name,
                        "kind": f.kind,
                        "rows": f.rows,
                        "size": f.size,
                        "uri": st.file_uri(m, f.name),
                    }
                    for f in m.files
                ],
            }
            for m in manifests
        ]
        shown: dict[str, object] = {"run_id": run_id, "store": st.url, "config_hash": rec.config_hash}
        shown |= {"code_version": rec.code_version, "stages": stages}
        if report is not None:
            shown["plots"] = [st.file_uri(report, name) for name in report.summary.get("plots", [])]
            shown["report"] = st.file_uri(report, "report.md")
        shown["rescores"] = [_rescore_entry(st, r) for r in rescores]
        shown |= _family_json(family)
        _print_json(shown)
        return
    out.print(
        f"run [bold]{escape(run_id)}[/] in {st.url}  config {rec.config_hash[:12]}  code {rec.code_version}",
        soft_wrap=True,
    )
    table = Table("stage", "artifact", "kind", "rows", "size", "committed")
    for m in manifests:
        if is_rescore(m):  # listed below, one line per rescore
            continue
        for i, f in enumerate(m.files):
            table.add_row(
                m.stage if i == 0 else "",
                f.name,
                f.kind or "-",
                "-" if f.rows is None else str(f.rows),
                _human(f.size),
                m.producer.created_at[:19] if i == 0 else "",
            )
    _print_table(table)
    if report is not None:
        out.print("plots:")
        for name in report.summary.get("plots", []):
            out.print(f"  {st.file_uri(report, name)}", highlight=False, soft_wrap=True)
        out.print(
            f"  per-iteration table: {st.file_uri(report, 'report.md')}", highlight=False, soft_wrap=True
        )
        _print_mlflow_location(st.url, run_id)
    _print_family(family)
    if rescores:
        out.print("rescores (verl-flow rescore):")
        for r in rescores:
            found = "not finished (rerun the same command to resume)"
            if r.report is not None:
                t = r.report.summary["total"]
                found = (
                    f"agreement {t['agreement']:.4f}, accuracy {t['accuracy_old']:.4f} → "
                    f"{t['accuracy_new']:.4f}, report {st.file_uri(r.report, 'report.md')}"
                )
            out.print(
                f"  {r.name}  reward config {r.reward_config_hash[:12]}  {r.stages} stages  {found}",
                highlight=False,
                soft_wrap=True,
            )


def _link_text(link: RunLink) -> str:
    if link.kind == "missing":
        return f"{link.run_id}  (not in this store)"
    if link.parent is None:
        return link.run_id
    rewards = f", rewards of rescore {link.rewards}" if link.rewards else ""
    return f"{link.run_id}  {link.kind} of {link.parent}@{link.iteration}{rewards}"


def _print_family(family: FamilyTree) -> None:
    """The family tree (parents up the chain, forks and replays down) and this run's own forks and
    replays; nothing for a run without either."""
    if not family.ancestors and not family.descendants:
        return
    out.print("family (verl-flow run --fork, verl-flow replay):")
    chain = [*reversed(family.ancestors), family.run]
    for depth, link in enumerate(chain):
        mark = "   <- this run" if link is family.run else ""
        out.print(f"  {'  ' * depth}{_link_text(link)}{mark}", highlight=False, soft_wrap=True)
    for depth, link in family.descendants:
        out.print(f"  {'  ' * (len(chain) - 1 + depth)}{_link_text(link)}", highlight=False, soft_wrap=True)
    children = [link for depth, link in family.descendants if depth == 1]
    for kind in ("replay", "fork"):
        mine = [link for link in children if link.kind == kind]
        if mine:
            out.print(f"{kind}s of this run:")
            for link in mine:
                out.print(f"  {_link_text(link)}", highlight=False, soft_wrap=True)


def _family_json(family: FamilyTree) -> dict[str, object]:
    def entry(link: RunLink) -> dict[str, object]:
        return {
            "run_id": link.run_id, "kind": link.kind, "parent": link.parent, "iteration": link.iteration,
            "rewards": link.rewards,
        }  # fmt: skip

    children = [link for depth, link in family.descendants if depth == 1]
    me = family.run
    parent = None
    if me.parent is not None:
        parent = {"run_id": me.parent, "iteration": me.iteration, "kind": me.kind, "rewards": me.rewards}
    return {
        "parent": parent,
        "ancestors": [entry(a) for a in family.ancestors],
        "descendants": [{**entry(d), "depth": depth} for depth, d in family.descendants],
        "replays": [entry(c) for c in children if c.kind == "replay"],
        "forks": [entry(c) for c in children if c.kind == "fork"],
    }


def _rescore_entry(st: ArtifactStore, r: RescoreListing) -> dict[str, object]:
    entry: dict[str, object] = {
        "name": r.name,
        "reward_config_hash": r.reward_config_hash,
        "stages": r.stages,
    }
    entry["report"] = st.file_uri(r.report, "report.md") if r.report is not None else None
    if r.report is not None:
        total = r.report.summary["total"]
        entry |= {k: total[k] for k in ("rows", "agreement", "accuracy_old", "accuracy_new")}
    return entry


def _print_mlflow_location(store_url: str, run_id: str) -> None:
    from flows.runs import attach_run

    ctx, _ = attach_run(store_url, run_id)
    if ctx.mlflow_run_id:
        out.print(
            f"  MLflow: artifacts plots/ of run {ctx.mlflow_run_id} "
            f"(mlflow ui --backend-store-uri {ctx.tracking_uri})",
            highlight=False,
            soft_wrap=True,
        )


def _print_table(table: Table) -> None:
    """On a terminal, fitted to its width; piped (a file, a CI log), at the table's natural width so
    that no value is cut or ellipsized."""
    if out.is_terminal:
        out.print(table)
    else:
        Console(width=1 << 20, highlight=False).print(table)


def _print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


RunIdArg = Annotated[str, typer.Argument(help="Run id")]


def _serve_defaults() -> ServeConfig:
    from verl_core.runtime.serving import ServeConfig

    return ServeConfig()


def _serve_help(name: str) -> str:
    from verl_core.runtime.serving import ServeConfig

    return ServeConfig.model_fields[name].description or ""


_SERVE = _serve_defaults()  # `serve`'s option defaults are ServeConfig's (verl_core/runtime/serving.py)
IterationOpt = Annotated[
    int | None,
    typer.Option(
        "--iteration", help="RL iteration of the checkpoint (default: the latest; 0: the SFT policy)"
    ),
]


@app.command("export")
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
        _fail(e, 2)
    except VerlFlowError as e:
        _fail(e, 1)
    out.print(f"exported {manifest.summary['source']} of run {run_id}: {uri}")
    reg = manifest.summary.get("registered_model")
    if reg:
        out.print(f"registered in MLflow as {reg['name']} version {reg['version']} ({reg['source']})")
    if dest:
        out.print(f"model directory: {dest}")


@app.command("eval")
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
        _fail(e, 2)
    except VerlFlowError as e:
        _fail(e, 1)
    _print_eval(source.label, report, samples)
    out.print(f"samples and report: {uri}")


@app.command("rescore")
def rescore_cmd(
    run_id: RunIdArg,
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="reward.* (and sandbox.*) settings, e.g. reward.gsm8k_method=flexible"),
    ] = None,
    iterations: Annotated[
        str | None,
        typer.Option(
            "--iterations",
            help="A:B: only training/validation iterations A <= i < B (also A:, :B, N); eval stages are "
            "rescored only without it",
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name", help="Name of the rescore (default: the new reward config's hash, 8 hex digits)"
        ),
    ] = None,
    store: StoreOpt = None,
) -> None:
    """Score every stored rollout of RUN_ID (training, validation, eval) again with the reward settings
    changed by OVERRIDES into rescore/NAME/..., and compare with the stored rewards (report: Parquet,
    markdown, a plot; an MLflow child run of the run). Idempotent: a rerun skips what was committed."""
    from stages.floor.locations import check_rescore_name
    from stages.floor.rescore import check_rescore_overrides, parse_iterations

    try:  # what can be checked before the flow starts, in one line
        check_rescore_overrides(overrides or [])
        if iterations is not None:
            parse_iterations(iterations)
        if name is not None:
            check_rescore_name(name)
        _store(store).read_run_record(run_id)  # a run that is not there: one line, before the flow starts
    except ConfigError as e:
        _fail(e, 2)
    except VerlFlowError as e:
        _fail(e, 1)
    from verl_core.runtime.env import set_quiet_env

    set_quiet_env()
    from flows.prefect_api import check_api
    from flows.rescore import rescore_flow

    try:
        check_api()
        result = rescore_flow(
            run_id=run_id, overrides=overrides or [], iterations=iterations, name=name,
            store_url=store or StoreConfig().url,
        )  # fmt: skip
    except ConfigError as e:
        _fail(e, 2)
    except VerlFlowError as e:
        _fail(e, 1)
    _print_rescore(result)


def _print_rescore(result: RescoreResult) -> None:
    r = result.report
    table = Table(
        "source", "rows", "score stored → new", "accuracy stored → new", "agreement", "TT", "TF", "FT", "FF",
        "changed", title=f"rescore {result.name} of run {result.run_id}",
    )  # fmt: skip
    for p in [*r.parts, r.total]:
        table.add_row(
            p.source, str(p.rows), f"{p.score_old_mean:.4f} → {p.score_new_mean:.4f}",
            f"{p.accuracy_old:.4f} → {p.accuracy_new:.4f}", f"{p.agreement:.4f}",
            str(p.tt), str(p.tf), str(p.ft), str(p.ff), str(p.scores_changed),
        )  # fmt: skip
    _print_table(table)
    out.print(
        f"reward config {result.reward_config_hash[:12]}; {len(result.stages)} stages rescored in "
        f"rescore/{result.name}; wall time {result.wall_s:.1f} s, scoring {r.scoring_s:.1f} s (training "
        f"rollouts {r.train_scoring_s:.1f} s; the run's own rollout + reward of those iterations: "
        f"{r.original_s:.1f} s)",
        highlight=False,
        soft_wrap=True,
    )
    out.print(f"report: {result.report_uri}", highlight=False, soft_wrap=True)


@app.command("replay")
def replay_cmd(
    run_id: RunIdArg,
    start: Annotated[
        int, typer.Option("--from", min=1, help="Start from the run's checkpoint after this many updates")
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="algorithm.*, actor.*, critic.* settings, e.g. algorithm.adv_estimator=rloo"),
    ] = None,
    new_run_id: Annotated[
        str | None,
        typer.Option("--run-id", help="Run id of the replay (default: RUN_ID-replayITER-<config hash>)"),
    ] = None,
    rewards: Annotated[
        str | None,
        typer.Option("--rewards", help="Train on the rewards of the run's rescore NAME (verl-flow rescore)"),
    ] = None,
    store: StoreOpt = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Also show Prefect's failure lines and tracebacks")
    ] = False,
) -> None:
    """A new run that starts from RUN_ID's checkpoint at --from and trains the iterations after it on
    RUN_ID's stored rollouts and rewards (or a rescore's) with OVERRIDES, instead of sampling. With no
    overrides it reproduces RUN_ID's checkpoints bit for bit; settings that would change the rollouts
    are refused. Rerun the same command to resume."""
    from stages.floor.locations import check_rescore_name
    from stages.floor.parent import check_parent, replay_config, replay_run_id

    try:  # the overrides, the parent's checkpoint and its stored data: one line, before any work
        if rewards is not None:
            check_rescore_name(rewards)
        st = _store(store)
        cfg = replay_config(st, run_id, start, overrides or [], rewards)
        new_run_id = new_run_id or replay_run_id(run_id, start, cfg.config_hash())
        check_parent(st, cfg, new_run_id)
    except ConfigError as e:
        _fail(e, 2)
    except VerlFlowError as e:
        _fail(e, 1)

    def replay() -> PipelineResult:
        from flows.replay import replay_flow

        return replay_flow(
            run_id=run_id, start_iteration=start, overrides=overrides or [], new_run_id=new_run_id,
            rewards=rewards, store_url=st.url,
        )  # fmt: skip

    _run_logged(cfg, new_run_id, verbose, replay)


@app.command("serve")
def serve_cmd(
    target: Annotated[
        str, typer.Argument(help="Run id (its latest export) or an exported HF model directory")
    ],
    host: Annotated[str, typer.Option(help=_serve_help("host"))] = _SERVE.host,
    port: Annotated[int, typer.Option(help=_serve_help("port"))] = _SERVE.port,
    served_model_name: Annotated[
        str | None, typer.Option(help=_serve_help("served_model_name"))
    ] = _SERVE.served_model_name,
    tensor_parallel_size: Annotated[
        int, typer.Option(help=_serve_help("tensor_parallel_size"))
    ] = _SERVE.tensor_parallel_size,
    dtype: Annotated[str, typer.Option(help=_serve_help("dtype"))] = _SERVE.dtype,
    kv_cache_gib: Annotated[
        float | None, typer.Option(help=_serve_help("kv_cache_gib"))
    ] = _SERVE.kv_cache_gib,
    gpu_memory_utilization: Annotated[
        float, typer.Option(help=_serve_help("gpu_memory_utilization"))
    ] = _SERVE.gpu_memory_utilization,
    cpu_kv_cache_gib: Annotated[
        int, typer.Option(help=_serve_help("cpu_kv_cache_gib"))
    ] = _SERVE.cpu_kv_cache_gib,
    max_model_len: Annotated[
        int | None, typer.Option(help=_serve_help("max_model_len"))
    ] = _SERVE.max_model_len,
    enforce_eager: Annotated[bool, typer.Option(help=_serve_help("enforce_eager"))] = _SERVE.enforce_eager,
    health_timeout_s: Annotated[
        float, typer.Option(help=_serve_help("health_timeout_s"))
    ] = _SERVE.health_timeout_s,
    detach: Annotated[
        bool, typer.Option("--detach", help="Leave the server running in the background and return")
    ] = False,
    store: StoreOpt = None,
) -> None:
    """Serve TARGET with vLLM's OpenAI-compatible server (vLLM environment: make .venv-vllm): waits for
    /health, prints the URL and a curl line, then runs until Ctrl-C (or --detach)."""
    import shutil
    import tempfile

    from pydantic import ValidationError

    from flows.serving import resolve_model, serve
    from verl_core.runtime.serving import ServeConfig, curl_example

    settings = dict(locals())
    try:
        cfg = ServeConfig(**{k: settings[k] for k in ServeConfig.model_fields if k in settings})
    except ValidationError as e:
        _fail(e, 2, one_line=False)
    workdir = tempfile.mkdtemp(prefix="verl-flow-serve-")
    try:
        model = resolve_model(target, store or StoreConfig().url, workdir)
        out.print(f"starting vLLM on {model.model_dir} (log {workdir}/server.log) ...", highlight=False)
        handle = serve(model, cfg, f"{workdir}/server.log")
    except ConfigError as e:
        _fail(e, 2)
    except VerlFlowError as e:
        _fail(e, 1, one_line=False)
    out.print(f"serving {handle.model} at {handle.url}/v1 (OpenAI-compatible)", highlight=False)
    sys.stdout.write(curl_example(handle) + "\n")
    sys.stdout.flush()
    if detach:
        out.print(f"detached: pid {handle.process.pid}; stop with kill -TERM -{handle.process.pid}")
        return
    try:
        code = handle.wait()
    except KeyboardInterrupt:
        handle.stop()
        shutil.rmtree(workdir, ignore_errors=True)  # the written-out export and the log
        out.print("stopped")
        return
    _fail(
        f"the vLLM server exited with code {code}; log {handle.log_path}:\n{handle.log_tail()}",
        1,
        one_line=False,
    )


def _print_eval(label: str, report: EvalReport, samples: list[EvalSample]) -> None:
    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    k = report.k
    table = Table("data source", "prompts", "accuracy (greedy)", f"pass@{k}", title=f"eval of {label}")
    for source, a in report.by_source.items():
        table.add_row(source, str(a.prompts), f"{a.accuracy:.3f}", cell(a.pass_at_k))
    table.add_row("all", str(report.prompts), f"{report.accuracy:.3f}", cell(report.pass_at_k))
    _print_table(table)
    for row in samples:
        mark = "✓" if row.correct else "✗"
        out.print(f"{mark} {row.response!r} (answer {row.extracted!r}, expected {row.ground_truth!r})")


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
