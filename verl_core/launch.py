"""The torchrun command of an SPMD job (the SFT stage or the RL loop on several processes).

One function builds it for every place that launches one: the flows on this host
(:mod:`flows.spmd`), the Kubernetes job and the Slurm script of ``infra/`` (which call
``verl-flow spmd-command`` so they run exactly this command). torchrun (torch.distributed elastic)
starts ``nproc_per_node`` workers on each of ``nnodes`` nodes that meet through a c10d rendezvous;
each worker runs ``python -m flows.spmd --job JOB_URI``.

    one node:   torchrun --standalone --nnodes 1 --nproc-per-node G --max-restarts 0 -m flows.spmd --job URI
    N nodes:    torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT
                         --rdzv-id ID --max-restarts 0 -m flows.spmd --job URI

``--max-restarts 0``: a failed rank fails the job (the stage's own resume restarts it from its last
checkpoint, under Prefect's control), torchrun does not restart workers behind the flow's back.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

WORKER_MODULE = "flows.spmd"


@dataclass(frozen=True)
class LaunchSpec:
    """Geometry of one SPMD job. ``rdzv_endpoint`` None: one node, a rendezvous on this host."""

    nnodes: int
    nproc_per_node: int
    rdzv_id: str
    rdzv_endpoint: str | None = None

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


def torchrun_command(spec: LaunchSpec, job_uri: str, *, python: str | None = None) -> list[str]:
    """The argv that runs the SPMD job described at ``job_uri`` (see :mod:`flows.spmd`) with ``spec``."""
    argv = [python or sys.executable, "-m", "torch.distributed.run"]
    if spec.rdzv_endpoint is None:
        argv += ["--standalone", "--nnodes", "1"]
    else:
        argv += [
            "--nnodes", str(spec.nnodes),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", spec.rdzv_endpoint,
            "--rdzv-id", spec.rdzv_id,
        ]  # fmt: skip
    argv += ["--nproc-per-node", str(spec.nproc_per_node), "--max-restarts", "0"]
    return [*argv, "-m", WORKER_MODULE, "--job", job_uri]
