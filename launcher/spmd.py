"""SPMD jobs: a stage (the SFT stage, the RL loop) on several processes (``trainer.nnodes ×
trainer.n_gpus_per_node``, or any sharded strategy), launched with torchrun.

The launching side (:func:`run_job`, called by the SFT and RL-loop flows) writes the job spec (run
context, config, the entry point's arguments) to a private directory, hands the worker its Prefect
context, runs :func:`verl_core.runtime.launch.torchrun_command` and waits. The worker side (``python -m
launcher.spmd --job PATH``, every rank): joins the process group, receives the job from node 0, and
calls the job's entry point (an import path, ``"flows.gpu:rl_rank"``, resolved here: the launcher
imports nothing of the flows), which runs the very stage code a single process runs:

* the main rank (node 0's first, :mod:`verl_core.runtime.ranks`) runs it inside the parent flow run's Prefect
  context (its tasks appear in the parent flow run; it talks to the parent's API, never starting a
  server of its own), commits the artifacts and logs to MLflow/W&B;
* the other ranks run the same functions without Prefect (the tasks' ``.fn``) and with no tracker,
  and follow the main rank through collectives (:mod:`verl_core.runtime.ranks`).

A rank that dies (an exception, SIGKILL, OOM) ends the job: torchrun (``--max-restarts 0``) stops the
other ranks, and :class:`SpmdJobError` names the failed rank, its exit code and its error. Nothing
half-written is visible (only the main rank commits, through manifests); the stage's own resume picks up
from the last checkpoint when the flow runs again, with any world size.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from launcher.follow import launch_spec
from verl_core.config import VerlFlowConfig
from verl_core.errors import VerlFlowError
from verl_core.runtime.launch import FOLLOWER_JOB_URI, JOB_INFO_ENV, JobInfo, torchrun_command, write_job_info
from verl_core.runtime.run import RunContext

PREFECT_CONTEXT_ENV = "VERL_FLOW_PREFECT_CONTEXT"  # file with the parent flow run's serialised context


class SpmdJob(BaseModel):
    """What every rank of one job runs (JSON, written by the launching flow).

    ``entry`` is called on every rank as ``entry(ctx, config, as_tasks=..., **args)`` and returns the
    stage's result (JSON-ready; the main rank's is the job's); ``as_tasks``: this rank runs the stages
    as Prefect tasks of the flow run named by ``flow`` (the main rank, when the launcher had one)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: str  # the job's name in messages and in what followers learn ("sft", "rl-loop")
    entry: str  # "module:function" every rank runs
    flow: str  # "module:flow": the Prefect flow whose run the main rank joins
    ctx: RunContext
    config: VerlFlowConfig
    args: dict[str, Any]  # the entry's keyword arguments (JSON values)
    final: bool = True  # the last SPMD job of the pipeline: followers stop after it
    result_path: str | None = None  # the main rank writes the stage's result (JSON) here


class SpmdJobError(VerlFlowError):
    """The torchrun job failed; the message names the rank, its exit code and its error."""


def needs_spmd(cfg: VerlFlowConfig) -> bool:
    """More than one process, or a sharded strategy (fsdp2/deepspeed need a process group even alone)."""
    strategies = (cfg.actor.strategy, cfg.critic.strategy if cfg.use_critic else "single", cfg.ref.strategy)
    return cfg.world_size > 1 or any(s != "single" for s in strategies)


def run_job(job: SpmdJob) -> dict[str, Any]:
    """Run ``job`` under torchrun on this host (node 0 of a multi-node job) and wait; returns what rank
    0 wrote as the result. Raises :class:`SpmdJobError` when any rank fails."""
    with tempfile.TemporaryDirectory(prefix="verl-flow-spmd-") as tmp:
        result = Path(tmp, "result.json")
        job_path = Path(tmp, "job.json")
        job_path.write_text(job.model_copy(update={"result_path": str(result)}).model_dump_json())
        env = {**os.environ, **_prefect_env(Path(tmp))}
        spec = launch_spec(job.config)
        code, tail = _run_streaming(torchrun_command(spec, str(job_path)), env)
        if code != 0:
            raise SpmdJobError(f"{job.stage} job of run {job.ctx.run_id!r}: {failure_summary(tail, code)}")
        if not result.exists():
            raise SpmdJobError(f"{job.stage} job of run {job.ctx.run_id!r}: the main rank left no result")
        return json.loads(result.read_text())  # type: ignore[no-any-return]


def _prefect_env(tmp: Path) -> dict[str, str]:
    """The parent flow run's context for the main rank, and the API it runs against (the temporary
    server of a serverless run included), so the main rank reports into the same flow run. Written as
    JSON (no pickle): the flow run, its settings, result store and tags (the flow is the job's stage's)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext, TagsContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow is None:
        return {}
    fields = {"flow_run", "log_prints", "start_time", "persist_result"}  # what Prefect serialises too
    run_context = ctx.model_dump(mode="json", include=fields, exclude_unset=True)
    if ctx.result_store is not None:
        run_context["result_store"] = ctx.result_store.model_dump(
            mode="json", serialize_as_any=True, exclude_unset=True
        )
    spec = {"flow_run_context": run_context, "tags": sorted(TagsContext.get().current_tags)}
    path = tmp / "prefect-context.json"
    path.write_text(json.dumps(spec))
    with get_client(sync_client=True) as client:
        api_url = str(client.api_url)
    return {PREFECT_CONTEXT_ENV: str(path), "PREFECT_API_URL": api_url}


def _run_streaming(argv: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    """Run ``argv`` with its output passed through to ours; returns the exit code and the last 400
    lines of its stderr (where torchrun summarises a failure)."""
    tail: deque[str] = deque(maxlen=400)
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    assert proc.stderr is not None

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            tail.append(line.rstrip("\n"))
            sys.stderr.write(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait()
    except BaseException:  # interrupted: take the job down with us
        proc.terminate()
        proc.wait()
        raise
    reader.join(timeout=5)
    return code, list(tail)


_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.*)$")
_RULE = re.compile(r"^\s*[=-]{10,}\s*$")
_ENTRY = re.compile(r"^\s*\[\d+\]:\s*$")


def _report_entries(lines: list[str]) -> list[tuple[dict[str, str], str]]:
    """The failures of one section of torchrun's report (``lines`` after its heading, up to a rule):
    ``(fields, error)`` per ``[i]:`` entry, ``error`` the traceback's last line."""
    entries: list[tuple[dict[str, str], str]] = []
    in_traceback = False
    for line in lines:
        if _RULE.match(line):
            break
        if _ENTRY.match(line):
            entries.append(({}, ""))
            in_traceback = False
            continue
        if not entries:
            continue
        fields, error = entries[-1]
        m = _FIELD.match(line)
        if m and not in_traceback:
            fields[m.group(1)] = m.group(2).strip()
            in_traceback = m.group(1) == "traceback"
            error = fields.get("traceback", "")
        elif in_traceback and line.strip():
            error = line.strip()  # the exception line comes last
        entries[-1] = (fields, error)
    return entries


def _exit_code(fields: dict[str, str], default: str) -> str:
    return fields.get("exitcode", default).split(" (")[0].strip()


def failure_summary(stderr_tail: list[str], code: int) -> str:
    """One line from torchrun's failure report: the failed rank, its exit code (negative: the signal
    that killed it) and its error (the traceback's last line); torchrun's exit code and last line when
    there is no report.

    The rank is torchrun's "Root Cause" (the earliest error file or exit it saw), except where that
    rank was stopped by torchrun itself (SIGTERM) and another was killed by a signal: a rank killed
    from outside (kill -9, the OOM killer) writes no error file, so a peer whose collective failed a
    moment later ("Connection closed by peer") can be timed first, then SIGTERMed."""
    start = next((i for i, s in enumerate(stderr_tail) if "Root Cause" in s), None)
    if start is None:
        last = next((s.strip() for s in reversed(stderr_tail) if s.strip()), "")
        return f"torchrun exited with code {code}" + (f" ({last})" if last else "")
    roots = _report_entries(stderr_tail[start + 1 :])
    fields, error = roots[0] if roots else ({}, "")
    failures = next((i for i, s in enumerate(stderr_tail[:start]) if s.strip() == "Failures:"), None)
    if _exit_code(fields, str(code)) == "-15" and failures is not None:
        killed = [
            (f, e)
            for f, e in _report_entries(stderr_tail[failures + 1 : start])
            if _exit_code(f, "0").startswith("-") and _exit_code(f, "0") != "-15"
        ]
        if killed:
            fields, error = killed[0]
    where = fields.get("rank", "?").split(" (")[0]
    exitcode = _exit_code(fields, str(code))
    if error.startswith("To enable traceback"):  # torchrun's hint, not the error
        error = ""
    return f"rank {where} failed with exit code {exitcode}" + (f": {error}" if error else "")


# -- worker side (every rank) -------------------------------------------------------------------------


def _receive_job(job_arg: str) -> SpmdJob:
    """Node 0's ranks read the job file, followers (:data:`FOLLOWER_JOB_URI`) have none; every rank
    takes it from the lowest rank that read it, which becomes the main rank (it holds the Prefect
    context and the result path, which live on node 0)."""
    from verl_core.runtime.ranks import all_gather, rank, set_main

    text = Path(job_arg).read_text() if job_arg != FOLLOWER_JOB_URI else None
    holders = [(r, t) for r, t in all_gather([(rank(), text)]) if t is not None]
    if not holders:
        raise SpmdJobError("no rank of this job was given its job spec (every node ran as a follower)")
    main, spec = min(holders, key=lambda h: h[0])
    set_main(main)
    return SpmdJob.model_validate_json(spec)


def _prefect_context(flow: Any) -> AbstractContextManager[Any]:
    """The main rank inside the parent flow run's context (when the launcher passed one): ``flow`` (the
    flow that launched the job), the flow run and its fields validated back from JSON."""
    path = os.environ.get(PREFECT_CONTEXT_ENV)
    if not path:
        return nullcontext()
    from prefect.context import hydrated_context

    spec = json.loads(Path(path).read_text())
    serialized = {
        "flow_run_context": {**spec["flow_run_context"], "flow": flow},
        "tags_context": {"current_tags": set(spec["tags"])},
    }
    return hydrated_context(serialized)


def resolve(path: str) -> Any:
    """The object at ``"package.module:name"`` (an SPMD job's entry point or flow)."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise SpmdJobError(f"an SPMD entry point is 'module:name', got {path!r}")
    return getattr(importlib.import_module(module), name)


def run_rank(job: SpmdJob) -> dict[str, Any] | None:
    """This rank's part of ``job``: its entry point, the main rank inside the launching flow run's
    Prefect context (when it has one) and with the run's trackers, the others without; the main rank
    returns the stage's result (JSON-ready)."""
    from verl_core.runtime.ranks import is_main

    main = is_main()
    prefect = main and bool(os.environ.get(PREFECT_CONTEXT_ENV))
    ctx = job.ctx if main else job.ctx.model_copy(update={"mlflow_run_id": None, "wandb_run_id": None})
    entry = resolve(job.entry)
    with _prefect_context(resolve(job.flow)) if prefect else nullcontext():
        result: dict[str, Any] = entry(ctx, job.config, as_tasks=prefect, **job.args)
    return result if main else None


def main(argv: list[str] | None = None) -> None:
    """Entry point of every rank: ``python -m launcher.spmd --job PATH`` (``rendezvous`` on followers)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    parser = argparse.ArgumentParser(prog="python -m launcher.spmd")
    parser.add_argument("--job", required=True, help=f"job spec file on node 0, or {FOLLOWER_JOB_URI!r}")
    args = parser.parse_args(argv)
    record(_worker)(args.job)


def _worker(job_arg: str) -> None:
    import torch
    import torch.distributed as dist

    from verl_core.runtime.ranks import barrier, is_main
    from verl_core.training.distributed import init_distributed

    # the job (and its stall timeout) is known only after joining: a generous bound for the join itself;
    # NCCL beside gloo wherever a GPU is visible
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    init_distributed(device_type, float(os.environ.get("VERL_FLOW_JOIN_TIMEOUT_S", "1800")))
    try:
        job = _receive_job(job_arg)
        info = os.environ.get(JOB_INFO_ENV)
        if info and os.environ.get("LOCAL_RANK", "0") == "0":  # a follower learns what it ran
            write_job_info(info, JobInfo(job.stage, job.final))
        result = run_rank(job)
        if is_main() and job.result_path and result is not None:
            Path(job.result_path).write_text(json.dumps(result))
        barrier()  # nobody leaves before the main rank's last commit (a follower's next job waits)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _exit_past_held_groups()


def _exit_past_held_groups() -> None:
    """End a rank that finished its job without interpreter finalization. Its process group can be
    referenced past ``destroy_process_group``: DeepSpeed's module-level world group and ZeRO-3
    parameters' ``ds_process_group``; an FSDP2 model's state, in a reference cycle with its module,
    holds the mesh until a collection. gloo's shutdown does not stop its threads, so they end in the
    group's destructor, during finalization when nothing freed it earlier: a gloo thread taking the
    GIL then is ended by ``pthread_exit`` through a noexcept destructor, "terminate called without
    an active exception" (SIGABRT), and torchrun fails a job whose result is already written (a
    two-rank test worker with an FSDP2 policy on gloo: 1 run in 60). The exit handlers (logging,
    trackers) run first, while every thread is alive; then the process exits 0."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
