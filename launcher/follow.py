"""A follower node of multi-node SPMD jobs (``verl-flow spmd-follow``), nodes 1..N−1 of a run.

Node 0 runs the pipeline (or a stage flow) and launches each SPMD job (SFT, then the RL loop) with
``verl_core.runtime.launch.torchrun_command``; a follower runs the same command with the job URI
``rendezvous``, once per job, until the job it ran was the run's last one:

    1. run torchrun with ``VERL_FLOW_JOB_INFO`` naming a fresh file;
    2. its workers join node 0's rendezvous, get the job spec, and local rank 0 writes the job's
       ``{"stage", "final"}`` there;
    3. no file: no job started (node 0 not launching yet, or its previous job's store still closing):
       try again after ``retry_s``, for at most ``wait_s`` since the last job ended;
    4. a file and a non-zero exit: the job failed, stop with one line naming the job and its stage;
    5. a file and exit 0: a job done; stop when it was final or after ``max_jobs`` jobs.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from verl_core.config import VerlFlowConfig
from verl_core.errors import VerlFlowError
from verl_core.runtime.launch import (
    FOLLOWER_JOB_URI,
    JOB_INFO_ENV,
    JobInfo,
    LaunchSpec,
    read_job_info,
    torchrun_command,
)

Runner = Callable[[list[str], Mapping[str, str]], int]
"""Runs an argv with an environment and returns its exit code (tests inject a fake torchrun)."""


def launch_spec(cfg: VerlFlowConfig) -> LaunchSpec:
    """The geometry of ``cfg``'s SPMD jobs: what node 0 launches and its followers must pass."""
    t = cfg.trainer
    return LaunchSpec(
        nnodes=t.nnodes, nproc_per_node=t.n_gpus_per_node, rdzv_id=t.rdzv_id, rdzv_endpoint=t.rdzv_endpoint
    )


class FollowError(VerlFlowError):
    """A follower's job failed, or no job came within the wait; the message is one line."""


@dataclass(frozen=True)
class FollowResult:
    """The jobs this follower ran, in order, and the torchrun attempts that found no job."""

    jobs: tuple[JobInfo, ...]
    idle_attempts: int


def run_subprocess(argv: list[str], env: Mapping[str, str]) -> int:
    """Run ``argv`` in the foreground (its output goes to ours) and return its exit code."""
    return subprocess.run(argv, env=dict(env), check=False).returncode


def follow(
    spec: LaunchSpec,
    *,
    max_jobs: int | None = None,
    wait_s: float = 3600.0,
    retry_s: float = 5.0,
    runner: Runner | None = None,
    python: str | None = None,
    module: str | None = None,
    log: Callable[[str], None] = print,
) -> FollowResult:
    """Follow node 0's SPMD jobs at ``spec.rdzv_endpoint`` (module docstring, steps 1-5).

    ``max_jobs``: stop after this many jobs even if none was final (a Kubernetes Job per stage flow
    run holds exactly one). ``wait_s``: how long to keep trying for the next job. ``python``/``module``:
    as in :func:`torchrun_command` (tests)."""
    if spec.rdzv_endpoint is None:
        raise FollowError("spmd-follow needs --rdzv-endpoint HOST:PORT (node 0's rendezvous)")
    kwargs = {} if module is None else {"module": module}
    argv = torchrun_command(spec, FOLLOWER_JOB_URI, python=python, **kwargs)
    run = runner or run_subprocess  # looked up at call time (a test swaps the module's)
    jobs: list[JobInfo] = []
    idle = 0
    deadline = time.monotonic() + wait_s
    with tempfile.TemporaryDirectory(prefix="verl-flow-follow-") as tmp:
        for attempt in itertools.count():
            info_file = Path(tmp) / f"job-{attempt}.json"  # 1. fresh per attempt
            rc = run(argv, {**os.environ, JOB_INFO_ENV: str(info_file)})
            info = read_job_info(info_file)  # 2.
            if info is None:  # 3. no job started
                idle += 1
                if time.monotonic() + retry_s > deadline:
                    raise FollowError(
                        f"no SPMD job from {spec.rdzv_endpoint} (rdzv id {spec.rdzv_id}) within {wait_s:g} s "
                        f"after job {len(jobs)}; the last torchrun exited with code {rc}"
                    )
                time.sleep(retry_s)
                continue
            n = len(jobs) + 1
            if rc != 0:  # 4.
                raise FollowError(f"SPMD job {n} (stage {info.stage}) failed: torchrun exited with code {rc}")
            jobs.append(info)  # 5.
            log(f"SPMD job {n} (stage {info.stage}) done{' (final)' if info.final else ''}")
            if info.final or (max_jobs is not None and n >= max_jobs):
                break
            deadline = time.monotonic() + wait_s
    return FollowResult(jobs=tuple(jobs), idle_attempts=idle)
