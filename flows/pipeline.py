"""The rlhf pipeline flow: runs the stages in order. It only orchestrates: every stage is a Prefect
task (or a flow) that takes its config section(s) and input manifest URIs and returns its output
manifest URI.

    preprocess ─► template_pack ─► sft_warmup ─► [rollout ─► reward ─► ppo_update] × N ─► export ─► eval

``execution.mode=local``: everything in this process (the RL loop a sub-flow). ``deployments``: this
flow runs on the ``cpu`` pool and starts SFT, the whole RL loop and the export as flow runs of their
deployments on the ``gpu`` pool (``run_deployment``); they meet only through the shared store.

Where SFT, the RL loop and the export run is chosen once, at the top (:mod:`flows.placement`).

A fork or replay (``config.parent``, :mod:`stages.floor.parent`) is checked before any work, once per
run (:mod:`flows.parent_check`: here, unless the caller hands over, in this process, its own check
of the same run), runs preprocess and template_pack itself, skips SFT and starts the RL loop from the
parent's checkpoint.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from flows.deployments import deployment_config, form_overrides, record_overrides
from flows.gating import require_promotion, run_gate
from flows.parent_check import check_once
from flows.placement import gpu_stages
from flows.prefect_artifacts import publish
from flows.results import PipelineResult
from flows.run_links import record_links
from flows.runs import run_id_of, start_run
from stages.eval import evaluate
from stages.floor.artifacts import export_source
from stages.floor.initial_model import fetch_initial_model
from stages.floor.logging import timed, watched
from stages.floor.registry import start_from
from stages.floor.reports import read_eval_report, sft_step_count
from stages.preprocess import preprocess
from stages.report import report
from stages.snapshot import resolve_snapshot
from stages.template_pack import template_pack
from verl_core.config import VerlFlowConfig, load_config, with_overrides
from verl_core.errors import ConfigError
from verl_core.runtime.run import RunContext, end_run
from verl_core.runtime.run_length import check_completed
from verl_core.store import ArtifactStore


@task(name="start-run")
def start_run_task(
    cfg: VerlFlowConfig, run_id: str | None, origin: dict[str, Any] | None = None
) -> RunContext:
    """Write run.json (with ``origin``: what the run started from) and create or resume the MLflow run."""
    return start_run(cfg, run_id, origin)


@task(name="finish-run")
def finish_run_task(ctx: RunContext, result: PipelineResult, status: str) -> None:
    tracker = ctx.tracker()
    tracker.log_dict(result.model_dump(mode="json"), "pipeline_result.json")
    tracker.end(status)
    end_run(ctx)  # release the run's lease


@flow(name="rlhf-pipeline", log_prints=True, validate_parameters=True)
def rlhf_pipeline(
    config: VerlFlowConfig = VerlFlowConfig(),
    overrides: list[str] | None = None,
    run_id: str | None = None,
    config_file: str | None = None,
) -> PipelineResult:
    """Run the whole pipeline for ``config`` (or the YAML ``config_file``, relative to the working
    directory) + dotted ``overrides`` as run ``run_id`` (None: experiment name + config hash).

    Args:
        config: The typed config. In a deployment's Run form it shows the config file's values and the
            fields changed there apply on top of ``config_file``; elsewhere it stays at the defaults
            when ``config_file`` is given (but ``parent``, a fork's start).
        overrides: Dotted overrides applied last, e.g. ``trainer.total_iterations=3``.
        run_id: The run's id in the store (None: experiment name + config hash; the same id resumes).
        config_file: A YAML config, relative to the worker's working directory (the checkout).
    """
    base, edits = _base_config(config, config_file)
    if edits is not None:  # from a deployment's config: the flow run records overrides, not the config
        if edits:
            get_run_logger().info("Run form: %s changed from the deployment's config", " ".join(edits))
        record_overrides([*(overrides or []), *edits])
    cfg = with_overrides(base, [*(overrides or []), *(edits or [])])
    snapshot = resolve_snapshot(cfg.data)
    cfg = cfg.model_copy(update={"data": snapshot.data})
    cfg, origin = start_from(cfg, snapshot.path)  # retrain.start_from: the champion's export, or the config
    gpu = gpu_stages(cfg.execution)  # SFT, RL, export: in this process or as deployments, chosen once
    s = cfg.store
    store = ArtifactStore(s.url, max_attempts=s.max_attempts, outage_budget_s=s.outage_budget_s)
    check_once(store, cfg, run_id or run_id_of(cfg))  # a fork or replay, before any work
    fetch_initial_model(cfg)  # model.path naming an export in the store: this machine's copy (template_pack)
    ctx = start_run_task(cfg, run_id, origin)
    record_links(ctx)  # runs/{run_id}/links.json: this flow run and the MLflow run (the rollout browser)
    get_run_logger().info(
        "run %s (%s mode): store %s, the run's files under runs/%s",
        ctx.run_id,
        cfg.execution.mode,
        ctx.store_url,
        ctx.run_id,
    )
    io_retry: dict[str, Any] = {
        "retries": cfg.execution.task_retries,
        "retry_delay_seconds": cfg.execution.retry_delay_s,
    }
    result = PipelineResult(run_id=ctx.run_id, data_snapshot=snapshot.path)
    stages, timing = result.stages, result.timing_s
    try:
        with timed(timing, "preprocess"):
            stages.preprocess = preprocess.with_options(**io_retry)(ctx, cfg.data)
        with timed(timing, "template_pack"):
            tools = cfg.rollout.multi_turn.tools if cfg.rollout.multi_turn.enable else []
            tp = template_pack.with_options(**io_retry)(ctx, cfg.data, cfg.model, stages.preprocess, tools)
        stages.template_pack = tp
        if cfg.sft.enable and cfg.parent is None:  # a fork starts from its parent's RL checkpoint
            # compute-bound: no task retries (a rerun resumes from the last checkpoint)
            with timed(timing, "sft"):
                stages.sft = gpu.sft(ctx, cfg, tp)
            # the stages check their own counts; this catches a short count committed by a stage
            # flow run elsewhere (a deployment)
            result.sft_steps = check_completed("sft", sft_step_count(ctx.store(), stages.sft))
        with timed(timing, "rl"):
            rl = gpu.rl(ctx, cfg, tp, stages.sft)
        stages.rl, result.rl_iterations = rl.checkpoint, rl.iterations
        result.val_accuracy, result.rl_timing_s = rl.val_accuracy, rl.timing_s
        check_completed("rl", rl.iterations)
        if cfg.export.enable:
            with timed(timing, "export"):
                export_uri = gpu.export(ctx, cfg, tp)
            stages.export = export_uri
            if cfg.eval.enable:
                source = export_source(ctx.store(), export_uri)
                with timed(timing, "eval"), watched(ctx, "eval", cfg.execution.stall_timeout_s):
                    eval_uri = evaluate(ctx, cfg, tp, source)
                stages.eval, result.eval = eval_uri, read_eval_report(ctx.store(), eval_uri)
                if cfg.gate.enable:  # champion/challenger: promote or record the rejection
                    with timed(timing, "gate"):
                        stages.gate, result.gate = run_gate(ctx, cfg, tp, eval_uri)
        stages.report = report(ctx, dict(timing), dict(result.rl_timing_s))
        publish(ctx, result, cfg.eval.table_rows)
        finish_run_task(ctx, result, "FINISHED")
    except BaseException:
        try:
            finish_run_task(ctx, result, "FAILED")
        except Exception as e:  # e.g. the store still down: the error that stopped the run is the news
            get_run_logger().warning("run %s: not marked FAILED, lease not released (%s)", ctx.run_id, e)
        raise
    require_promotion(cfg, result.gate)  # gate.require_promotion: a rejection fails the flow run (CI)
    return result


def _base_config(config: VerlFlowConfig, config_file: str | None) -> tuple[VerlFlowConfig, list[str] | None]:
    """``config``, or the YAML ``config_file`` when given, and the overrides to apply on top of it:
    from a deployment with a ``config`` parameter (the Run form's values), the fields ``config``
    changes from it (:mod:`flows.deployments`); elsewhere (None) ``config`` must be the default, but
    for ``config.parent``."""
    if config_file is None:
        return config, None
    loaded = load_config(config_file)  # validated again with the overrides (with_overrides)
    if config.model_copy(update={"parent": None}) == VerlFlowConfig():  # config_file (+ parent)
        parent = config.parent
        return (loaded if parent is None else loaded.model_copy(update={"parent": parent})), None
    shown = deployment_config()
    if shown is None:
        raise ConfigError("config_file: give either config_file or config fields (but parent), not both")
    return loaded, form_overrides(config, shown)
