"""The rlhf pipeline flow: runs the stages in order. It only orchestrates: every stage is a Prefect
task (or a flow) that takes its config section(s) and input manifest URIs and returns its output
manifest URI.

    preprocess ─► template_pack ─► sft_warmup ─► [rollout ─► reward ─► ppo_update] × N ─► export ─► eval

``execution.mode=local``: everything in this process (the RL loop a sub-flow). ``deployments``: this
flow runs on the ``cpu`` pool and starts SFT, the whole RL loop and the export as flow runs of their
deployments on the ``gpu`` pool (``run_deployment``); they meet only through the shared store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefect import flow, get_run_logger, task

from flows.artifacts import publish
from flows.dispatch import StageRunError, run_stage_deployment
from flows.gpu import export_flow, sft_flow
from flows.rl import rl_loop
from stages.eval import evaluate, export_source
from stages.export import export_stage, resolve_source
from stages.preprocess import preprocess
from stages.report import report
from stages.rl_state import list_checkpoints, policy_lineage
from stages.snapshot import resolve_snapshot
from stages.template_pack import template_pack
from verl_core.config import VerlFlowConfig, load_config, with_overrides
from verl_core.errors import ConfigError
from verl_core.run import RunContext, end_run, start_run


@task(name="start-run")
def start_run_task(cfg: VerlFlowConfig, run_id: str | None) -> RunContext:
    """Write run.json and create or resume the MLflow run."""
    return start_run(cfg, run_id)


@task(name="finish-run")
def finish_run_task(ctx: RunContext, result: dict[str, Any], status: str) -> None:
    tracker = ctx.tracker()
    tracker.log_dict(result, "pipeline_result.json")
    tracker.end(status)
    end_run(ctx)  # release the run's lease


@flow(name="rlhf-pipeline", log_prints=True, validate_parameters=True)
def rlhf_pipeline(
    config: VerlFlowConfig = VerlFlowConfig(),
    overrides: list[str] | None = None,
    run_id: str | None = None,
    config_file: str | None = None,
) -> dict[str, Any]:
    """Run the whole pipeline for ``config`` (or the YAML ``config_file``, relative to the working
    directory) + dotted ``overrides`` as run ``run_id`` (None: experiment name + config hash).

    Returns ``{"run_id", "stages": {stage: manifest URI}, "val_accuracy": {iteration: accuracy},
    "timing_s": {stage: seconds}, "eval": {...}, "data_snapshot"}``."""
    if config_file is not None:
        if config != VerlFlowConfig():
            raise ConfigError("config_file: give either config_file or config fields, not both")
        config = load_config(config_file)
    cfg = with_overrides(config, overrides or [])
    snapshot = resolve_snapshot(cfg.data)
    cfg = with_overrides(cfg, snapshot)
    logger = get_run_logger()
    ctx = start_run_task(cfg, run_id)
    logger.info(
        "run %s (%s mode), artifacts under %s/runs/%s",
        ctx.run_id,
        cfg.execution.mode,
        ctx.store_url,
        ctx.run_id,
    )
    io_retry: dict[str, Any] = {
        "retries": cfg.execution.task_retries,
        "retry_delay_seconds": cfg.execution.retry_delay_s,
    }
    result: dict[str, Any] = {
        "run_id": ctx.run_id,
        "stages": {},
        "val_accuracy": {},
        "timing_s": {},
        "eval": {},
    }
    result["data_snapshot"] = snapshot[0].split("=", 1)[1] if snapshot else None
    stages, timing = result["stages"], result["timing_s"]
    remote = cfg.execution.mode == "deployments"

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        timing[name] = round(time.perf_counter() - t0, 2)
        return out

    def dispatch(field: str, parameters: dict[str, Any], config_param: str = "config") -> None:
        deployment = getattr(cfg.execution, field)
        params = {"ctx": ctx.model_dump(mode="json"), config_param: cfg.model_dump(mode="json"), **parameters}
        run_stage_deployment(
            deployment, params, poll_interval_s=cfg.execution.poll_interval_s, field=f"execution.{field}"
        )

    try:
        stages["preprocess"] = timed("preprocess", lambda: preprocess.with_options(**io_retry)(ctx, cfg.data))
        stages["template_pack"] = timed(
            "template_pack",
            lambda: template_pack.with_options(**io_retry)(ctx, cfg.data, cfg.model, stages["preprocess"]),
        )
        tp = stages["template_pack"]
        if cfg.sft.enable:  # compute-bound: no task retries (a rerun resumes from the last checkpoint)
            if remote:
                timed("sft", lambda: dispatch("sft_deployment", {"template_pack_uri": tp}))
                stages["sft"] = ctx.store().manifest_uri(ctx.run_id, "sft")
            else:
                stages["sft"] = timed("sft", lambda: sft_flow(ctx, cfg, tp))
        if remote:
            rl_params = {"template_pack_uri": tp, "sft_uri": stages.get("sft")}
            timed("rl", lambda: dispatch("rl_deployment", rl_params, config_param="cfg"))
            rl = _rl_summary(ctx, cfg, stages.get("sft"))
        else:
            rl = timed("rl", lambda: rl_loop(ctx, cfg, tp, stages.get("sft")))
            timing.update({f"rl/{k}": round(v, 2) for k, v in rl["timing_s"].items()})
        stages["rl"] = rl["checkpoint"]
        result["val_accuracy"] = {str(k): v for k, v in rl["val_accuracy"].items()}
        if cfg.export.enable:
            if remote:
                timed("export", lambda: dispatch("export_deployment", {"iteration": None}))
                stages["export"] = _latest_export(ctx)
            else:
                stages["export"] = timed("export", lambda: export_flow(ctx, cfg, None))
            if cfg.eval.enable:
                source = export_source(ctx.store(), stages["export"])
                stages["eval"] = timed("eval", lambda: evaluate(ctx, cfg, source))
                result["eval"] = ctx.store().read_manifest(stages["eval"]).summary
        stages["report"] = report(ctx, dict(timing))
        publish(ctx, result, cfg.eval.table_rows)
        finish_run_task(ctx, result, "FINISHED")
    except BaseException:
        finish_run_task(ctx, result, "FAILED")
        raise
    return result


def _rl_summary(ctx: RunContext, cfg: VerlFlowConfig, sft_uri: str | None) -> dict[str, Any]:
    """What the RL loop returns, rebuilt from the store after its flow ran elsewhere: the last
    checkpoint and the validations of this policy lineage."""
    store = ctx.store()
    ckpts = list_checkpoints(store, ctx.run_id)
    if not ckpts:
        raise StageRunError(f"run {ctx.run_id!r}: the RL flow run completed but committed no checkpoint")
    lineage = policy_lineage(cfg, store.manifest_sha256(sft_uri) if sft_uri else None)
    val = {
        int(m.stage[len("iter-") : -len("/val")]): float(m.summary["accuracy"])
        for m in store.list_manifests(ctx.run_id)
        if m.stage.endswith("/val") and m.summary.get("iteration_lineage") == lineage
    }
    return {"checkpoint": store.manifest_uri(ctx.run_id, f"ckpt/iter-{ckpts[-1]:04d}"), "val_accuracy": val}


def _latest_export(ctx: RunContext) -> str:
    """The export of the run's latest checkpoint (what the export flow made when given no iteration)."""
    store = ctx.store()
    stage = export_stage(resolve_source(store, ctx.run_id, None))
    if store.committed(ctx.run_id, stage) is None:
        raise StageRunError(f"run {ctx.run_id!r}: the export flow run completed but committed no {stage}")
    return store.manifest_uri(ctx.run_id, stage)
