"""The torchrun command of an SPMD job (the SFT stage or the RL loop on several processes).

One function builds it for every place that launches one: the flows on this host
(:mod:`launcher.spmd`), the Kubernetes job and the Slurm script of ``infra/`` (which call
``verl-flow spmd-command`` so they run exactly this command). torchrun (torch.distributed elastic)
starts ``nproc_per_node`` workers on each of ``nnodes`` nodes that meet through a c10d rendezvous;
each worker runs ``python -m launcher.spmd --job JOB_URI``.

    one node: torchrun --standalone --nnodes 1 --nproc-per-node G --max-restarts 0 -m launcher.spmd --job URI
    N nodes:  torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT
                       --rdzv-id ID --rdzv-conf is_host=1|0 --max-restarts 0 -m launcher.spmd --job URI

``--max-restarts 0``: a failed rank fails the job (the stage's own resume restarts it from its last
checkpoint, under Prefect's control), torchrun does not restart workers behind the flow's back.

Multi-node: node 0 runs the pipeline (or the RL-loop flow) and launches its jobs with their job URI;
nodes 1..N−1 run ``verl-flow spmd-follow`` (:mod:`launcher.follow`), the same command with the job URI
:data:`FOLLOWER_JOB_URI`: their workers receive the job spec from node 0's after the rendezvous. Node 0
hosts the rendezvous store (``is_host=1``, stated rather than guessed from host names, which fails
when the endpoint is a DNS name not yet published, e.g. a Kubernetes Service), followers never do.
Every job of a run meets under the same ``rdzv_id`` (``trainer.rdzv_id``): a follower cannot know
which stage comes next, and each job is a fresh store (node 0's torchrun hosts it and exits with it).
On each node, local rank 0 of the worker writes a :class:`JobInfo` to the file named by
:data:`JOB_INFO_ENV` (when set) as soon as it knows its job, which is how a follower learns the stage
and whether more jobs follow.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

WORKER_MODULE = "launcher.spmd"
FOLLOWER_JOB_URI = "rendezvous"
"""Job URI of a follower node's workers: the spec comes from node 0 through the rendezvous store."""
JOB_INFO_ENV = "VERL_FLOW_JOB_INFO"
"""Environment variable naming the file where a node's local rank 0 writes its :class:`JobInfo`."""


@dataclass(frozen=True)
class LaunchSpec:
    """Geometry of one SPMD job (``trainer.*`` of the config, where the defaults live).
    ``rdzv_endpoint`` None: one node, a rendezvous on this host."""

    nnodes: int
    nproc_per_node: int
    rdzv_id: str
    rdzv_endpoint: str | None

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError(f"nnodes, nproc_per_node must be ≥ 1, got {self.nnodes}, {self.nproc_per_node}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"trainer.rdzv_endpoint: a job on {self.nnodes} nodes needs the host:port of its rendezvous"
            )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def torchrun_command(
    spec: LaunchSpec, job_uri: str, *, python: str | None = None, module: str = WORKER_MODULE
) -> list[str]:
    """The argv that runs the SPMD job described at ``job_uri`` (see :mod:`launcher.spmd`) with ``spec``;
    ``job_uri`` :data:`FOLLOWER_JOB_URI` on follower nodes. ``module``: the worker (tests swap in a
    fake one to exercise the real torchrun rendezvous)."""
    argv = [python or sys.executable, "-m", "torch.distributed.run"]
    if spec.rdzv_endpoint is None:
        argv += ["--standalone", "--nnodes", "1"]
    else:
        is_host = 0 if job_uri == FOLLOWER_JOB_URI else 1  # node 0 hosts the store (module docstring)
        argv += [
            "--nnodes", str(spec.nnodes),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", spec.rdzv_endpoint,
            "--rdzv-id", spec.rdzv_id,
            "--rdzv-conf", f"is_host={is_host}",
        ]  # fmt: skip
    argv += ["--nproc-per-node", str(spec.nproc_per_node), "--max-restarts", "0"]
    return [*argv, "-m", module, "--job", job_uri]


@dataclass(frozen=True)
class JobInfo:
    """What a node learns about the SPMD job it joined: the stage, and whether it is the run's last job."""

    stage: str
    final: bool


def write_job_info(path: str | Path, info: JobInfo) -> None:
    """Write ``info`` as JSON ``{"stage": ..., "final": ...}`` (the worker, local rank 0 of each node)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"stage": info.stage, "final": info.final}))
    tmp.replace(path)  # a reader sees the whole file or none


def read_job_info(path: str | Path) -> JobInfo | None:
    """The :class:`JobInfo` at ``path``, None when no worker wrote one (no job started on this node)."""
    p = Path(path)
    if not p.is_file():
        return None
    raw = json.loads(p.read_text())
    return JobInfo(stage=str(raw["stage"]), final=bool(raw["final"]))
