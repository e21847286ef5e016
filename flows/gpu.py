"""The GPU-heavy parts of the pipeline as flows of their own, deployed on the ``gpu`` work pool and
started by the pipeline with ``run_deployment`` in ``execution.mode=deployments``. They take the run
context and the config, and meet the pipeline only through artifacts in the shared store.

Every stage flow names its config parameter ``config`` (see :func:`flows.dispatch.dispatch`). The RL
loop's flow is :func:`flows.rl.rl_loop` itself (one flow run for all iterations, so the
policy, reference and critic stay in GPU memory between them). Each starts with
:func:`stages.floor.initial_model.fetch_initial_model` (a ``model.path`` naming an export in the store, a
champion's: this worker's copy, fetched once) and :func:`stages.floor.environment.check_environment`: the
worker's packages and torch build against what the config needs, the fast part of ``verl-flow doctor``.

An SPMD job (:mod:`launcher.spmd`) of the SFT stage or the RL loop runs :func:`sft_rank` or
:func:`rl_rank` on every rank, named in the job by import path (``"flows.gpu:rl_rank"``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.heartbeat import heartbeat
from flows.progress import to_pipeline
from flows.rl import rl_iterations
from launcher.spmd import SpmdJob, needs_spmd, run_job
from stages.export import export_model
from stages.floor.environment import check_environment
from stages.floor.initial_model import fetch_initial_model
from stages.floor.logging import watched
from stages.sft import sft_warmup
from verl_core.config import VerlFlowConfig
from verl_core.runtime.run import RunContext


@flow(name="sft-warmup", log_prints=True)
def sft_flow(ctx: RunContext, config: VerlFlowConfig, template_pack_uri: str) -> str:
    """SFT warm-up of the run; returns the sft stage's manifest URI.

    Args:
        ctx: The run's context (run id, store, tracking), set by the pipeline that dispatches this.
        config: The run's resolved config.
        template_pack_uri: The template_pack stage's manifest (tokenizer and packed SFT data).
    """
    # dispatched: the pipeline tells it alive from preempted by the heartbeat; its steps in the pipeline's log
    with heartbeat(ctx, config), to_pipeline():
        fetch_initial_model(config)  # model.path naming an export in the store: this worker's copy
        check_environment(config)  # this worker's packages and torch build can run the config (no network)
        if needs_spmd(config):  # every rank runs sft_rank (launcher.spmd), rank 0 as this flow run's task
            job = SpmdJob(
                stage="sft", entry="flows.gpu:sft_rank", flow="flows.gpu:sft_flow", ctx=ctx, config=config,
                args={"template_pack_uri": template_pack_uri}, final=False,
            )  # fmt: skip
            return str(run_job(job)["sft_uri"])
        with watched(ctx, "sft", config.execution.stall_timeout_s):
            return sft_warmup(ctx, config.model, config.sft, config.trainer, template_pack_uri, config.actor)


@flow(name="export-model", log_prints=True)
def export_flow(
    ctx: RunContext, config: VerlFlowConfig, template_pack_uri: str, iteration: int | None = None
) -> str:
    """Merged HF export of a policy checkpoint (None: the latest) with the run's tokenizer (from
    ``template_pack_uri``); returns the export's manifest URI.

    Args:
        ctx: The run's context (run id, store, tracking), set by the pipeline that dispatches this.
        config: The run's resolved config.
        template_pack_uri: The template_pack stage's manifest (the tokenizer exported with the model).
        iteration: The RL checkpoint to export (empty: the latest).
    """
    with heartbeat(ctx, config):
        fetch_initial_model(config)  # a LoRA's pretrained base: this worker's copy of a store URI
        check_environment(config)
        with watched(ctx, "export", config.execution.stall_timeout_s, iteration):
            return export_model(ctx, config, template_pack_uri, iteration)


def sft_rank(
    ctx: RunContext, config: VerlFlowConfig, *, as_tasks: bool, template_pack_uri: str
) -> dict[str, Any]:
    """Every rank's part of the SFT job: ``sft_warmup`` (a task of the launching flow run on the main
    rank, ``as_tasks``); returns ``{"sft_uri": ...}``."""
    fetch_initial_model(config)  # every rank is a process of its own, on any node
    fn = sft_warmup if as_tasks else sft_warmup.fn
    c = config
    # every rank watched, as rl_iterations' stages are: a rank stuck (in a collective too) is failed
    with watched(ctx, "sft", c.execution.stall_timeout_s):
        uri = fn(ctx, c.model, c.sft, c.trainer, template_pack_uri, c.actor)
    return {"sft_uri": uri}


def rl_rank(
    ctx: RunContext, config: VerlFlowConfig, *, as_tasks: bool, template_pack_uri: str, sft_uri: str | None
) -> dict[str, Any]:
    """Every rank's part of the RL-loop job: :func:`flows.rl.rl_iterations`; returns its result as JSON."""
    fetch_initial_model(config)  # every rank is a process of its own, on any node
    return rl_iterations(ctx, config, template_pack_uri, sft_uri, as_tasks=as_tasks).to_json()
