"""The rescore flow (``verl-flow rescore``, deployment ``rescore/rescore`` on the cpu pool): a run's
stored rollouts (training, validation, eval) scored again with other ``reward.*`` settings, compared
with the stored rewards. It only orchestrates:

    attach to the run ─► plan (name, reward config hash, stages) ─► rescore ─► rescore-report ─► artifact

Nothing of the run is written but ``rescore/{name}/...``; every rescored stage is committed on its
own, so a killed rescore, run again, skips what it committed (see :mod:`stages.rescore`).
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger

from flows.prefect_artifacts import publish_rescore
from flows.results import RescoreResult
from flows.runs import attach_run
from stages.floor.rescore import plan_rescore, read_rescore_report, rescore_lease, rescore_settings
from stages.rescore import rescore, rescore_report
from verl_core.config import StoreConfig


@flow(name="rescore", log_prints=True, validate_parameters=True)
def rescore_flow(
    run_id: str,
    overrides: list[str] | None = None,
    iterations: str | None = None,
    name: str | None = None,
    store_url: str | None = None,
) -> RescoreResult:
    """Rescore run ``run_id`` (store ``store_url``, default ./runs) with its reward settings changed by
    ``overrides`` (``reward.*``, ``sandbox.*`` only) into ``rescore/{name}/...`` (``name`` default: the
    new reward config's hash, 8 hex digits); ``iterations`` "A:B": only training/validation iterations
    A ≤ i < B (eval stages only without it).

    Args:
        run_id: The run to rescore, as its store names it (``runs/<run_id>``).
        overrides: Dotted reward settings, e.g. ``reward.function=my_reward.py:compute_score``; only
            ``reward.*`` and ``sandbox.*`` (verl's ``custom_reward_function.*`` names are translated).
        iterations: ``A:B`` rescores training and validation iterations A ≤ i < B too; empty: eval only.
        name: The rescore's name under ``rescore/`` (empty: the new reward config's hash, 8 hex digits).
        store_url: The store holding the run (empty: the worker's ``./runs``).
    """
    t0 = time.perf_counter()
    ctx, cfg = attach_run(store_url or StoreConfig().url, run_id)
    new = rescore_settings(cfg, overrides or [])
    store = ctx.store()
    plan = plan_rescore(store, run_id, new, overrides or [], name, iterations)
    get_run_logger().info(
        "rescore %s of run %s: %d stages, reward config %s",
        plan.name, run_id, len(plan.targets), plan.reward_config_hash[:12],
    )  # fmt: skip
    e = cfg.execution
    with rescore_lease(store, run_id, plan.name, cfg.store.lease_ttl_s):
        units = rescore.with_options(retries=e.task_retries, retry_delay_seconds=e.retry_delay_s)(
            ctx, new.reward, new.sandbox, plan, cfg.data.max_response_length
        )
        report_uri = rescore_report(ctx, plan, units)
    result = RescoreResult(
        run_id=run_id,
        name=plan.name,
        reward_config_hash=plan.reward_config_hash,
        stages={t.stage: uri for t, uri in zip(plan.targets, units, strict=True)},
        report_uri=report_uri,
        report=read_rescore_report(store, report_uri),
        wall_s=time.perf_counter() - t0,
    )
    publish_rescore(ctx, result)
    get_run_logger().info("rescore %s of run %s: %.1f s wall time", plan.name, run_id, result.wall_s)
    return result
