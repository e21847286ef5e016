"""The rlhf pipeline flow: runs the stages in order. It only orchestrates: every stage is a Prefect
task (the RL loop a sub-flow) that takes its config section(s) and input manifest URIs and returns
its output manifest URI.

    preprocess ─► template_pack ─► sft_warmup ─► [rollout ─► reward ─► ppo_update] × N ─► export ─► eval

Export and eval follow their issue.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, task

from flows.rl import rl_loop
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
def finish_run_task(ctx: RunContext, result: dict[str, Any], status: str) -> None:
    tracker = ctx.tracker()
    tracker.log_dict(result, "pipeline_result.json")
    tracker.end(status)


@flow(name="rlhf-pipeline", log_prints=True, validate_parameters=True)
def rlhf_pipeline(
    config: VerlFlowConfig = VerlFlowConfig(),
    overrides: list[str] | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Run the whole pipeline for ``config`` (+ dotted ``overrides``) as run ``run_id``.

    Returns ``{"run_id", "stages": {stage: manifest URI}, "val_accuracy": {iteration: accuracy},
    "timing_s": {stage: seconds}}``."""
    cfg = with_overrides(config, overrides or [])
    if cfg.execution.mode != "local":
        raise ConfigError("execution.mode: 'deployments' is not available yet; use 'local'")
    logger = get_run_logger()
    ctx = start_run_task(cfg, run_id)
    logger.info("run %s, artifacts under %s/runs/%s", ctx.run_id, ctx.store_url, ctx.run_id)
    io_retry: dict[str, Any] = {
        "retries": cfg.execution.task_retries,
        "retry_delay_seconds": cfg.execution.retry_delay_s,
    }
    result: dict[str, Any] = {"run_id": ctx.run_id, "stages": {}, "val_accuracy": {}, "timing_s": {}}
    stages, timing = result["stages"], result["timing_s"]

    def timed(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        timing[name] = round(time.perf_counter() - t0, 2)
        return out

    try:
        stages["preprocess"] = timed("preprocess", lambda: preprocess.with_options(**io_retry)(ctx, cfg.data))
        stages["template_pack"] = timed(
            "template_pack",
            lambda: template_pack.with_options(**io_retry)(ctx, cfg.data, cfg.model, stages["preprocess"]),
        )
        if cfg.sft.enable:  # compute-bound: no task retries (a rerun resumes from the last checkpoint)
            stages["sft"] = timed(
                "sft", lambda: sft_warmup(ctx, cfg.model, cfg.sft, cfg.trainer, stages["template_pack"])
            )
        rl = timed("rl", lambda: rl_loop(ctx, cfg, stages["template_pack"], stages.get("sft")))
        stages["rl"] = rl["checkpoint"]
        result["val_accuracy"] = {str(k): v for k, v in rl["val_accuracy"].items()}
        timing.update({f"rl/{k}": round(v, 2) for k, v in rl["timing_s"].items()})
        finish_run_task(ctx, result, "FINISHED")
    except BaseException:
        finish_run_task(ctx, result, "FAILED")
        raise
    return result
