"""The RL iteration loop: rollout → reward → ppo_update, × the planned iterations
(:func:`stages.floor.specs.planned_iterations`, computed once by the RL session), with validation
and checkpoints. One flow run, so in local mode the policy, reference and critic stay in memory across
iterations (artifacts are still written for every stage). The calls of one loop share one context
(:class:`flows.loop.Loop`: run, config, prompts, lineage, timings, and the stage callables, Prefect tasks
or their functions, chosen once by :func:`loop_stages`).

The RL session (:class:`stages.floor.session.RLSession`: models, engine, scorers, cursor, version) is
the loop's: :func:`rl_iterations` binds a slot for it (:func:`stages.floor.session.bound`), the
``init_rl_state`` task opens it there, the loop's helpers receive it as a parameter, and each RL task
shell looks it up once; the loop closes it at its end. Prefect's task parameters stay the run context,
config sections and URIs.

Resume (``trainer.resume_mode``): the loop starts after the last committed checkpoint; iterations
whose rollout/reward artifacts are committed are not sampled again (same seeds → same data).

The loop ends with the policy holding every planned update or fails (:mod:`verl_core.runtime.run_length`):
a policy short of the plan never gets the final checkpoint. Each stage runs under the hang watchdog
(``execution.stall_timeout_s``, :func:`stages.floor.logging.watched`).

Replay (``parent.replay``, ``verl-flow replay``): the loop starts from the parent's checkpoint and
each iteration's rollout and reward URIs are the parent's stored ones
(:func:`stages.floor.parent.replay_sources`); nothing is sampled or scored, validation runs as usual.

One-step off-policy overlap (``trainer.rollout_ahead=1``, one process, an engine with its own weights):
iteration i+1's rollout is sampled from policy i in a worker thread while iteration i is scored and
updated (:func:`_overlapped`); the engine is synced at the iteration boundary, after that rollout, and
a checkpoint is taken only after it is committed, so a resume samples nothing committed again.
Iteration 0 (and a resumed run's first iteration, committed already) is rolled out first, alone.

More than one process (``trainer.nnodes × trainer.n_gpus_per_node``) or a sharded strategy: the flow
runs :func:`rl_iterations` as an SPMD job under torchrun (:mod:`launcher.spmd`); every rank runs the same
loop, the main rank runs the stages as tasks of this flow run and scores the rollouts, the others follow.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from contextvars import copy_context
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple, TypeVar

import torch
from prefect import flow, task
from prefect.cache_policies import NONE

from flows.heartbeat import heartbeat
from flows.loop import Loop, LoopStages
from flows.progress import stage_line, to_pipeline
from flows.sampling import sample_iteration
from launcher.spmd import SpmdJob, needs_spmd, run_job
from stages.floor.checkpoint import save_checkpoint
from stages.floor.environment import check_environment
from stages.floor.initial_model import fetch_initial_model
from stages.floor.lineage import RLResult
from stages.floor.locations import ckpt_stage, validations
from stages.floor.logging import stage_logger, timed, watched
from stages.floor.opening import open_session
from stages.floor.parent import replay_sources
from stages.floor.session import (
    RLSession,
    bound,
    engine_held,
    session_of,
    set_prompt_cursor,
    slot_of,
    sync_rollout_weights,
)
from stages.floor.specs import iteration_count
from stages.ppo_update import ppo_update
from stages.reward import reward
from stages.rollout import rollout
from stages.validate import validate
from verl_core.config import VerlFlowConfig
from verl_core.data.prompt_stream import iteration_cursor
from verl_core.runtime.ranks import on_main
from verl_core.runtime.run import RunContext
from verl_core.runtime.run_length import check_completed

T = TypeVar("T")


@task(name="init_rl_state")
def init_rl_state(
    ctx: RunContext, config: VerlFlowConfig, template_pack_uri: str, sft_uri: str | None
) -> int:
    """Open the run's RL session into the slot the loop bound (:func:`stages.floor.session.bound`);
    returns the iteration the loop starts from."""
    return slot_of(ctx).fill(open_session(ctx, config, template_pack_uri, sft_uri)).version


@task(name="checkpoint")
def checkpoint(ctx: RunContext, config: VerlFlowConfig, iteration: int) -> str:
    return save_checkpoint(session_of(ctx), ctx, config, iteration)


class IterationArtifacts(NamedTuple):
    """Manifest URIs of one RL iteration's stages (dynamic sampling: its last generation batch's
    rollout and reward, :func:`flows.sampling.sample_iteration`)."""

    rollout: str
    reward: str
    update: str


def run_iteration(loop: Loop, session: RLSession, iteration: int) -> IterationArtifacts:
    """rollout → reward → ppo_update of one iteration, adding each stage's seconds to ``loop.timings``.
    In an SPMD job the main rank alone scores (the others get the URI)."""
    ctx, cfg = loop.ctx, loop.config
    if cfg.parent is not None and cfg.parent.replay:  # the parent's stored rollouts and rewards
        set_prompt_cursor(session, iteration_cursor(iteration + 1, cfg.data.train_batch_size))
        r, w = replay_sources(ctx.store(), cfg.parent, iteration)
        return IterationArtifacts(r, w, _update(loop, iteration, r, w))
    if cfg.algorithm.filter_groups.enable:  # DAPO dynamic sampling: generation batches until full
        s = sample_iteration(loop, session, iteration)
        return IterationArtifacts(
            s.rollouts[-1], s.rewards[-1], _update(loop, iteration, s.rollouts, s.rewards)
        )
    # one batch per iteration: the next one starts where this one ends
    set_prompt_cursor(session, iteration_cursor(iteration + 1, cfg.data.train_batch_size))
    r = _rollout_call(loop, iteration)
    _stage_line(loop, iteration, "reward")
    with timed(loop.timings, "reward"), watched(ctx, "reward", cfg.execution.stall_timeout_s, iteration):
        w = on_main(
            lambda: loop.stages.reward(
                ctx, cfg.reward, r, iteration, cfg.data.max_response_length, sandbox=cfg.sandbox
            )
        )
    return IterationArtifacts(r, w, _update(loop, iteration, r, w))


def _update(loop: Loop, iteration: int, rollouts: str | list[str], rewards: str | list[str]) -> str:
    """Iteration ``iteration``'s update stage (timed, watched)."""
    ctx, cfg = loop.ctx, loop.config
    _stage_line(loop, iteration, "update")
    with timed(loop.timings, "update"), watched(ctx, "ppo_update", cfg.execution.stall_timeout_s, iteration):
        return loop.stages.update(ctx, cfg, rollouts, rewards, iteration)


@flow(name="rl-loop", log_prints=True)
def rl_loop(ctx: RunContext, config: VerlFlowConfig, template_pack_uri: str, sft_uri: str | None) -> RLResult:
    """Run the RL iterations; returns the final checkpoint URI, validation accuracies and timings.

    Args:
        ctx: The run's context (run id, store, tracking), set by the pipeline that dispatches this.
        config: The run's resolved config.
        template_pack_uri: The template_pack stage's manifest (tokenizer and prompts).
        sft_uri: The SFT stage's manifest the policy starts from (empty: the model as configured).
    """
    # dispatched: the pipeline tells it alive from preempted by the heartbeat, and logs its progress
    with heartbeat(ctx, config), to_pipeline():
        fetch_initial_model(config)  # model.path naming an export in the store: this worker's copy
        check_environment(config)  # this worker's packages and torch build can run the config (no network)
        if needs_spmd(config):
            job = SpmdJob(
                stage="rl-loop", entry="flows.gpu:rl_rank", flow="flows.rl:rl_loop", ctx=ctx, config=config,
                args={"template_pack_uri": template_pack_uri, "sft_uri": sft_uri},
            )  # fmt: skip
            return RLResult.from_json(run_job(job))
        return rl_iterations(ctx, config, template_pack_uri, sft_uri)


def rl_iterations(
    ctx: RunContext,
    config: VerlFlowConfig,
    template_pack_uri: str,
    sft_uri: str | None,
    *,
    as_tasks: bool = True,
) -> RLResult:
    """The loop itself, in this process (one rank of an SPMD job, or the only process).
    ``as_tasks=False`` calls the stage functions without Prefect task runs (the benchmarks' baseline,
    the other ranks of an SPMD job). The loop binds a slot for the run's RL session, which its init
    task opens and its task shells look up (:mod:`stages.floor.session`); the session is closed when
    the loop ends (its rollout engine, a vLLM process, and its scorers with it)."""
    with bound(ctx.run_id) as slot:
        try:
            return _iterations(
                ctx, config, template_pack_uri, sft_uri, loop_stages(config, as_tasks=as_tasks)
            )
        finally:
            slot.close()


def _iterations(
    ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, sft_uri: str | None, stages: LoopStages
) -> RLResult:
    """:func:`rl_iterations` inside its bound slot: opens the session (the init stage), then runs."""
    logger = stage_logger(__name__)
    t, store = cfg.trainer, ctx.store()
    ahead = t.rollout_ahead and not (cfg.parent is not None and cfg.parent.replay)  # a replay samples none
    val: dict[int, float] = {}
    timings = {"rollout": 0.0, "reward": 0.0, "update": 0.0, "validate": 0.0}
    start = stages.init(ctx, cfg, template_pack_uri, sft_uri)
    session = slot_of(ctx).opened()  # one rollout engine for the whole loop (closed by rl_iterations)
    total = session.iterations
    loop = Loop(ctx, cfg, template_pack_uri, session.lineage, total, timings, stages)
    if t.val_before_train and start == 0 and t.test_freq:
        val[0] = _validate_call(loop, 0)
    last_ckpt = None
    if ahead and start < total:  # iteration `start`'s rollout first (committed on a resume)
        _rollout_call(loop, start)
    for it in range(start, total):
        if ahead and it + 1 < total:  # rollout i+1 (policy i) ∥ reward i + update i
            _overlapped(loop, session, it)
        else:
            run_iteration(loop, session, it)
        done = it + 1
        if t.test_freq and (done % t.test_freq == 0 or done == total):
            val[done] = _validate_call(loop, done)
        if done == total:  # the final checkpoint marks the plan done: not for a policy short of it
            check_completed("rl", iteration_count(cfg, session.iterations, session.version))
        if done == total or (t.save_freq and done % t.save_freq == 0):
            last_ckpt = stages.checkpoint(ctx, cfg, done)
        acc = f", val accuracy {val[done]:.3f}" if done in val else ""
        logger.info("rl: iteration %d/%d done%s", done, total, acc)
    iterations = check_completed("rl", iteration_count(cfg, session.iterations, session.version))
    if last_ckpt is None:  # nothing left to run: the final checkpoint is already committed
        last_ckpt = store.manifest_uri(ctx.run_id, ckpt_stage(total))
    for done, accuracy in validations(store, ctx.run_id, loop.lineage).items():  # of earlier (resumed) runs
        val.setdefault(done, accuracy)
    return RLResult(last_ckpt, val, iterations, timings)


def _validate_call(loop: Loop, iteration: int) -> float:
    """The validation of policy version ``iteration`` (timed, watched), with the sections it reads."""
    ctx, cfg = loop.ctx, loop.config
    with timed(loop.timings, "validate"), watched(ctx, "validate", cfg.execution.stall_timeout_s, iteration):
        return loop.stages.validate(
            ctx, cfg.data, cfg.rollout, cfg.reward, cfg.eval, cfg.sandbox, loop.template_pack_uri, iteration,
            cfg.tracking.log_samples,
        )  # fmt: skip


def _rollout_call(loop: Loop, iteration: int) -> str:
    """Iteration ``iteration``'s rollout stage (timed, watched), the one call of it: run_iteration and
    the ahead rollout make the same call, so run_iteration finds an ahead rollout committed and skips it."""
    ctx, cfg = loop.ctx, loop.config
    _stage_line(loop, iteration, "rollout")
    with timed(loop.timings, "rollout"), watched(ctx, "rollout", cfg.execution.stall_timeout_s, iteration):
        return loop.stages.rollout(
            ctx, cfg.data, cfg.rollout, loop.template_pack_uri, iteration, loop.lineage,
            cfg.algorithm.greedy_baseline, sandbox=cfg.sandbox,
        )  # fmt: skip


def _stage_line(loop: Loop, iteration: int, stage: str) -> None:
    """``rl: iteration 3/10: reward`` (iteration index 2 in progress), rate-limited (flows.progress)."""
    stage_line(loop.ctx.run_id, f"rl: iteration {iteration + 1}/{loop.iterations}: {stage}")


def _ahead_rollout_body(loop: Loop, iteration: int, threads: int | None) -> tuple[str, float]:
    """The ahead rollout in its worker thread: its own torch thread count (OpenMP's is per thread),
    its own watchdog and timer; returns (URI, seconds)."""
    if threads is not None:
        torch.get_num_threads()  # this thread's lazy OpenMP init first, so the next call sticks
        torch.set_num_threads(threads)
    alone = replace(loop, timings={"rollout": 0.0})
    uri = _rollout_call(alone, iteration)
    return uri, alone.timings["rollout"]


# no cache key: its input is the loop context (stage callables, timings), and results are not cached
ahead_rollout = task(name="rollout_ahead", cache_policy=NONE)(_ahead_rollout_body)


def _in_thread(fn: Callable[..., T], *args: Any) -> Future[T]:
    """``fn(*args)`` in a worker thread of its own (the ahead rollout without Prefect task runs), in a
    copy of this context: the thread finds the loop's RL session (:func:`stages.floor.session.bound`),
    as a Prefect task runner's thread does."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
    try:
        return pool.submit(copy_context().run, fn, *args)
    finally:
        pool.shutdown(wait=False)  # the thread ends when fn returns


def loop_stages(config: VerlFlowConfig, *, as_tasks: bool = True) -> LoopStages:
    """The RL loop's stage callables, chosen here once: Prefect tasks (the reward stage with
    ``execution.task_retries``), or with ``as_tasks=False`` their plain functions."""
    e = config.execution
    if as_tasks:
        score = reward.with_options(retries=e.task_retries, retry_delay_seconds=e.retry_delay_s)
        return LoopStages(
            init_rl_state, rollout, score, ppo_update, validate, checkpoint, ahead_rollout.submit
        )
    return LoopStages(
        init_rl_state.fn, rollout.fn, reward.fn, ppo_update.fn, validate.fn, checkpoint.fn,
        partial(_in_thread, _ahead_rollout_body),
    )  # fmt: skip


def _overlapped(loop: Loop, session: RLSession, iteration: int) -> None:
    """Iteration ``iteration`` with ``trainer.rollout_ahead=1``: iteration i+1's rollout is generated
    from policy i in a worker thread (a Prefect task submitted to the flow's thread-pool task runner,
    or a plain thread without tasks) while :func:`run_iteration` scores and updates iteration i (its
    rollout is already committed: a skip). The engine holds version i until the ahead rollout is done
    (:func:`stages.floor.session.engine_held`), then receives i+1: the iteration boundary. On CPU the
    torch threads are split, half to the rollout, the rest to the update (restored after).

    Runs every stage of the iteration to its end or raises; the ahead rollout is waited for either
    way (its failure is raised when the update succeeded), so the caller's checkpoint comes after it
    is committed: a resume from that checkpoint finds it and generates nothing again."""
    cpu = session.device.type == "cpu"
    total_threads = torch.get_num_threads()
    rollout_threads = max(1, total_threads // 2) if cpu else None
    with engine_held(session):
        future = loop.stages.ahead(loop, iteration + 1, rollout_threads)
        if cpu:
            torch.set_num_threads(max(1, total_threads - total_threads // 2))
        try:
            run_iteration(loop, session, iteration)
        except BaseException:
            _wait(future)  # no thread left sampling a session the caller is about to close
            raise
        finally:
            if cpu:
                torch.set_num_threads(total_threads)
        _uri, seconds = future.result()
    loop.timings["rollout"] += seconds
    with timed(loop.timings, "weight_sync"):  # the boundary: the engine moves to the trainer's version
        sync_rollout_weights(session)


def _wait(future: Any) -> None:
    """Wait for a future, ignoring its outcome (the caller is already failing)."""
    with suppress(BaseException):  # the caller's error is the one to report
        future.result()
