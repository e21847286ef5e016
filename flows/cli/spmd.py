"""The multi-node commands: ``spmd-command`` (the torchrun command of a config's SPMD jobs) and
``spmd-follow`` (a follower node, :mod:`launcher.follow`)."""

from __future__ import annotations

import shlex
import sys
from typing import Annotated

import typer

from flows.cli.common import OverridesArg, fail, out
from verl_core.config import VerlFlowConfig, load_config
from verl_core.errors import ConfigError
from verl_core.runtime.launch import FOLLOWER_JOB_URI, LaunchSpec, torchrun_command


def spmd_command(
    overrides: OverridesArg = None,
    config: Annotated[
        str | None, typer.Option("--config", help="YAML config (default: the schema's defaults)")
    ] = None,
    job: Annotated[
        str, typer.Option("--job", help="Job URI (default: a follower's, the spec comes from node 0)")
    ] = FOLLOWER_JOB_URI,
) -> None:
    """Print the torchrun command of the config's SPMD jobs (trainer.nnodes, n_gpus_per_node,
    rdzv_endpoint, rdzv_id): what node 0 runs for a job, and what spmd-follow runs on the others."""
    from launcher.follow import launch_spec

    try:
        spec = launch_spec(_load_optional(config, overrides))
    except ValueError as e:
        fail(e, 2)
    sys.stdout.write(shlex.join(torchrun_command(spec, job)) + "\n")


def _load_optional(config: str | None, overrides: list[str] | None) -> VerlFlowConfig:
    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        fail(e, 2, one_line=False)


def spmd_follow(
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Nodes of the job (trainer.nnodes)")],
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", min=1, help="Processes per node (trainer.n_gpus_per_node)")
    ],
    rdzv_endpoint: Annotated[
        str, typer.Option("--rdzv-endpoint", help="HOST:PORT of node 0 (trainer.rdzv_endpoint)")
    ],
    rdzv_id: Annotated[
        str | None, typer.Option("--rdzv-id", help="Rendezvous id (trainer.rdzv_id; default: its default)")
    ] = None,
    max_jobs: Annotated[
        int | None,
        typer.Option("--max-jobs", min=1, help="Stop after this many jobs (default: the final)"),
    ] = None,
    wait_s: Annotated[
        float, typer.Option("--wait-s", help="Seconds to keep trying for the next job before failing")
    ] = 3600.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the torchrun command and exit")] = False,
) -> None:
    """Run a follower node (1..N−1) of a multi-node run: node 0's SPMD jobs, one torchrun each, until
    the final one. A failed job prints one line (job, stage, exit code) and exits 1."""
    from verl_core.config import TrainerConfig

    try:
        spec = LaunchSpec(
            nnodes=nnodes,
            nproc_per_node=nproc_per_node,
            rdzv_id=rdzv_id or TrainerConfig.model_fields["rdzv_id"].default,
            rdzv_endpoint=rdzv_endpoint,
        )
    except ValueError as e:
        fail(e, 2)
    if dry_run:
        sys.stdout.write(shlex.join(torchrun_command(spec, FOLLOWER_JOB_URI)) + "\n")
        return
    from launcher.follow import FollowError, follow

    try:
        result = follow(spec, max_jobs=max_jobs, wait_s=wait_s, log=out.print)
    except FollowError as e:
        fail(e, 1)
    out.print(f"followed {len(result.jobs)} SPMD job(s): {', '.join(j.stage for j in result.jobs)}")
