"""The commands that run a pipeline flow: ``run``, ``replay``, ``rescore``, and ``config show`` (the
config a run would use). The full log of a run goes to a file; a failure prints one line
(:mod:`launcher.run_log`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from flows.cli.common import (
    ConfigArg,
    OverridesArg,
    RunIdArg,
    StoreOpt,
    fail,
    open_store,
    out,
    print_table,
)
from stages.floor.parent import parent_overrides, parse_parent_spec
from verl_core.config import StoreConfig, VerlFlowConfig, to_yaml
from verl_core.errors import ConfigError, VerlFlowError

if TYPE_CHECKING:
    from collections.abc import Callable

    from flows.results import PipelineResult, RescoreResult

config_app = typer.Typer(help="Inspect configurations.", no_args_is_help=True)


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
    require_promotion: Annotated[
        bool,
        typer.Option(
            "--require-promotion",
            help="Exit 3 with the gate's decision in one line unless the gate promoted the export (CI); "
            "needs gate.enable=true",
        ),
    ] = False,
) -> None:
    """Run the pipeline for CONFIG with OVERRIDES (the config is validated before any work).
    The full log goes to a file (logs/RUN_ID/ beside runs/ in a local store); a failure prints one line."""
    if fork is not None:
        try:
            overrides = [*(overrides or []), *parent_overrides(*parse_parent_spec(fork))]
        except ConfigError as e:
            fail(e, 2)
    cfg = _load_noted(config, overrides)
    if require_promotion and not cfg.gate.enable:
        fail("--require-promotion: gate.enable is false, so no gate decides (set gate.enable=true)", 2)
    checked = None
    if cfg.parent is not None:  # the parent's checkpoint: one line, before any work; the pipeline's check
        from flows.parent_check import check_start
        from flows.runs import run_id_of

        try:
            checked = check_start(open_store(cfg.store.url), cfg, run_id or run_id_of(cfg))
        except ConfigError as e:
            fail(e, 2)
        except VerlFlowError as e:
            fail(e, 1)
    from flows.cli.plan import check_fits

    unfit = check_fits(cfg)  # a run that cannot fit in this machine's memory: one line, before any work
    if unfit is not None:
        fail(unfit, 1)
    from stages.floor.environment import check_scorers

    try:  # a custom reward function that cannot be imported, called or score: one line, before any work
        check_scorers(cfg)
    except ConfigError as e:
        fail(e, 2)

    def pipeline() -> PipelineResult:
        from flows.parent_check import handed_over
        from flows.pipeline import rlhf_pipeline

        with handed_over(checked):  # checked once: here (in this process, never a flow parameter)
            return rlhf_pipeline(config=cfg, run_id=run_id)

    _run_logged(cfg, run_id, verbose, pipeline, require_promotion=require_promotion)


def _load_noted(config: str, overrides: list[str] | None) -> VerlFlowConfig:
    """``config`` with ``overrides``, validated (a bad one exits 2, one line per problem), and the
    loader's notes on the console before any work, one line each as ``config show`` prints them: each
    verl key translated (``verl key X → Y``), which of trainer.total_iterations/total_epochs ends the run."""
    from verl_core.config.loader import load_config_notes

    try:
        cfg, notes = load_config_notes(config, overrides or [])
    except ConfigError as e:
        fail(e, 2, one_line=False)
    for line in notes:  # markup off: a value such as [function] is text
        out.print(line, markup=False, highlight=False, soft_wrap=True)
    return cfg


def _run_logged(
    cfg: VerlFlowConfig,
    run_id: str | None,
    verbose: bool,
    call: Callable[[], PipelineResult],
    *,
    require_promotion: bool = False,
) -> None:
    """Run a pipeline flow (``call``) from the command line: Prefect quiet and its API checked first,
    the full log to the run's log file, a failure printed as one line (exit 2 for a config error, 3
    for a rejected challenger when ``require_promotion`` or ``gate.require_promotion`` asks for a
    promotion)."""
    from verl_core.runtime.env import set_quiet_env

    set_quiet_env()
    from launcher.prefect_api import check_api
    from launcher.run_log import RunLog, log_path

    try:
        check_api()
    except VerlFlowError as e:
        fail(e, 1)
    log = RunLog(log_path(cfg, run_id), verbose)
    try:
        result = call()
    except Exception as e:
        from flows.gating import PromotionRefused

        if isinstance(e, PromotionRefused):  # gate.require_promotion: the decision is the news
            fail(e, 3)
        fail(log.failure_line(e), 2 if isinstance(e, ConfigError) else 1)
    finally:
        log.close()
    _print_result(result)
    out.print(f"full log: {log.path}", highlight=False, soft_wrap=True)
    if require_promotion and result.gate is not None and result.gate.verdict != "pass":
        fail(result.gate.line, 3)


def _print_result(result: PipelineResult) -> None:
    """The summary a quickstart ends with: stages, validation accuracy before/after RL, wall times."""
    stages = Table("stage", "manifest", "seconds", title=f"run {result.run_id}")
    for name, uri in result.stages.ran().items():
        stages.add_row(name, uri, f"{result.timing_s.get(name, 0.0):.1f}")
    print_table(stages)
    acc = result.val_accuracy
    if acc:
        first, last = min(acc), max(acc)
        table = Table("validation", "iteration", "accuracy", title="held-out accuracy (greedy)")
        table.add_row("SFT checkpoint" if first == 0 else "first", str(first), f"{acc[first]:.3f}")
        table.add_row("after RL", str(last), f"{acc[last]:.3f}")
        table.add_row("change", "", f"{acc[last] - acc[first]:+.3f}")
        print_table(table)
    if result.gate is not None:
        out.print(result.gate.line, markup=False, highlight=False, soft_wrap=True)
    if result.rl_timing_s:
        times = Table("RL phase", "seconds", title="time inside the RL loop")
        for phase, seconds in result.rl_timing_s.items():
            times.add_row(phase, f"{seconds:.1f}")
        print_table(times)


@config_app.command("show")
def config_show(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Print the resolved config (YAML) and its hash; keys given in verl's form, one comment line each
    (verl key X → Y)."""
    from verl_core.config.loader import load_config_notes

    try:
        cfg, notes = load_config_notes(config, overrides or [])
    except ConfigError as e:
        fail(e, 2, one_line=False)
    sys.stdout.writelines(f"# {line}\n" for line in notes)
    sys.stdout.write(to_yaml(cfg))
    sys.stdout.write(f"# config_hash: {cfg.config_hash()}\n")


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
    from stages.floor.environment import check_scorers
    from stages.floor.locations import check_rescore_name
    from stages.floor.rescore import check_rescore_overrides, parse_iterations, rescore_settings

    try:  # what can be checked before the flow starts, in one line
        notes = check_rescore_overrides(overrides or [])  # verl's names translated (verl key X → Y)
        if iterations is not None:
            parse_iterations(iterations)
        if name is not None:
            check_rescore_name(name)
        # a run that is not there, a reward function that cannot score: one line, before the flow starts
        record = open_store(store).read_run_record(run_id)
        check_scorers(rescore_settings(_recorded_config(record.config), overrides or []))
    except ConfigError as e:
        fail(e, 2)
    except VerlFlowError as e:
        fail(e, 1)
    for line in notes:
        out.print(line, markup=False, highlight=False, soft_wrap=True)
    from verl_core.runtime.env import set_quiet_env

    set_quiet_env()
    from flows.rescore import rescore_flow
    from launcher.prefect_api import check_api
    from launcher.run_log import RunLog, log_path

    try:
        check_api()
    except VerlFlowError as e:
        fail(e, 1)
    store_url = store or StoreConfig().url
    # Prefect's failure lines and tracebacks to the log file; a failure prints one line (as `run`)
    log = RunLog(log_path(VerlFlowConfig.model_validate({"store": {"url": store_url}}), run_id), False)
    try:
        result = rescore_flow(
            run_id=run_id, overrides=overrides or [], iterations=iterations, name=name, store_url=store_url,
        )  # fmt: skip
    except Exception as e:
        fail(log.failure_line(e), 2 if isinstance(e, ConfigError) else 1)
    finally:
        log.close()
    _print_rescore(result)


def _recorded_config(raw: dict[str, Any]) -> VerlFlowConfig:
    """A run's recorded config, validated as the rescore flow takes it (executed locally)."""
    from verl_core.config import validate_config

    return validate_config({**raw, "execution": {**raw.get("execution", {}), "mode": "local"}})


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
    print_table(table)
    out.print(
        f"reward config {result.reward_config_hash[:12]}; {len(result.stages)} stages rescored in "
        f"rescore/{result.name}; wall time {result.wall_s:.1f} s, scoring {r.scoring_s:.1f} s (training "
        f"rollouts {r.train_scoring_s:.1f} s; the run's own rollout + reward of those iterations: "
        f"{r.original_s:.1f} s)",
        highlight=False,
        soft_wrap=True,
    )
    out.print(f"report: {result.report_uri}", highlight=False, soft_wrap=True)


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
    from flows.parent_check import BuiltReplay, check_start
    from stages.floor.locations import check_rescore_name
    from stages.floor.parent import replay_config, replay_run_id

    try:  # the overrides, the parent's checkpoint and its stored data: one line, before any work
        if rewards is not None:
            check_rescore_name(rewards)
        st = open_store(store)
        cfg = replay_config(st, run_id, start, overrides or [], rewards)
        new_run_id = new_run_id or replay_run_id(run_id, start, cfg.config_hash())
        checked = check_start(st, cfg, new_run_id)  # the pipeline's check, handed on: made once
        built = BuiltReplay(run_id, start, tuple(overrides or []), rewards, st.url, cfg)
    except ConfigError as e:
        fail(e, 2)
    except VerlFlowError as e:
        fail(e, 1)

    def replay() -> PipelineResult:  # the config built and the parent checked above, once
        from flows.parent_check import handed_over
        from flows.replay import replay_flow

        with handed_over(checked, built):  # in this process, never flow parameters
            return replay_flow(
                run_id=run_id, start_iteration=start, overrides=overrides or [], new_run_id=new_run_id,
                rewards=rewards, store_url=st.url,
            )  # fmt: skip

    _run_logged(cfg, new_run_id, verbose, replay)
