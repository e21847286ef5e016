"""The rlhf pipeline flow: runs the stages in order. It only orchestrates: every stage is a Prefect
task that takes its config section(s) and input manifest URIs and returns its output manifest URI.

    preprocess ─► template_pack ─► sft_warmup ─► [rollout ─► reward ─► ppo_update] × N ─► export ─► eval

Stages that exist so far are wired in; the rest follow their issues.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from stages.preprocess import preprocess
from stages.sft import sft_warmup
from stages.template_pack import template_pack
from verl_core.config import VerlFlowConfig, with_overrides
from verl_core.errors import ConfigError
from verl_core.run import RunContext, start_run


@task(name="start-run")
def start_run_task(cfg: VerlFlowConfig, run_id: str | None) -> RunContext:
    """Write run.json and create or resume the MLflow run."""
    return start_run(cfg, run_id)


@task(name="finish-run")
def finish_run_task(ctx: RunContext, stages: dict[str, str], status: str) -> None:
    tracker = ctx.tracker()
    tracker.log_dict(stages, "stages.json")
    tracker.end(status)


@flow(name="rlhf-pipeline", log_prints=True, validate_parameters=True)
def rlhf_pipeline(
    config: VerlFlowConfig = VerlFlowConfig(),
    overrides: list[str] | None = None,
    run_id: str | None = None,
) -> dict[str, str]:
    """Run the whole pipeline for ``config`` (+ dotted ``overrides``) as run ``run_id``.

    Returns the manifest URI of every stage, by stage name."""
    cfg = with_overrides(config, overrides or [])
    if cfg.execution.mode != "local":
        raise ConfigError("execution.mode: 'deployments' is not available yet; use 'local'")
    logger = get_run_logger()
    ctx = start_run_task(cfg, run_id)
    logger.info("run %s, artifacts under %s/runs/%s", ctx.run_id, ctx.store_url, ctx.run_id)
    retry: dict[str, Any] = {
        "retries": cfg.execution.task_retries,
        "retry_delay_seconds": cfg.execution.retry_delay_s,
    }
    stages: dict[str, str] = {}
    try:
        stages["preprocess"] = preprocess.with_options(**retry)(ctx, cfg.data)
        stages["template_pack"] = template_pack.with_options(**retry)(
            ctx, cfg.data, cfg.model, stages["preprocess"]
        )
        if cfg.sft.enable:  # compute-bound: no task retries (a rerun resumes from the last checkpoint)
            stages["sft"] = sft_warmup(ctx, cfg.model, cfg.sft, cfg.trainer, stages["template_pack"])
        finish_run_task(ctx, stages, "FINISHED")
    except BaseException:
        finish_run_task(ctx, stages, "FAILED")
        raise
    return stages
