"""A stand-in for ``launcher.spmd`` in tests/flows/test_infra_spmd.py: the real torchrun rendezvous and
gloo group, a fake job. Node 0's worker gets ``--job FILE`` (JSON ``{"stage", "final", "fail_follower"}``),
a follower's gets ``--job rendezvous``; the spec reaches every rank through an all-gather (whichever
rank node 0's worker got: c10d orders nodes by host name and pid, not by who launched first)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from verl_core.runtime.launch import FOLLOWER_JOB_URI, JOB_INFO_ENV, JobInfo, write_job_info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    job = parser.parse_args().job
    dist.init_process_group("gloo")
    mine = None if job == FOLLOWER_JOB_URI else json.loads(Path(job).read_text())
    specs: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(specs, mine)
    (spec,) = [s for s in specs if s is not None]
    if int(os.environ["LOCAL_RANK"]) == 0 and os.environ.get(JOB_INFO_ENV):
        write_job_info(os.environ[JOB_INFO_ENV], JobInfo(spec["stage"], spec["final"]))
    if spec.get("fail_follower") and job == FOLLOWER_JOB_URI:
        sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
