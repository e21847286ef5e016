"""A rank of an SPMD RL loop killed with SIGKILL mid-run: the job fails within a bounded time with an
error naming the rank, nothing half-written is visible, and a rerun of the same run id resumes from
the last checkpoint, on one process (a world size of 1, the single strategy).

The tiny pipeline (``tests/reliability/tiny.yaml``) without SFT runs its RL loop on 2 gloo ranks
(FSDP2 actor and critic, an HF engine with its own synced copy of the weights); the test waits until
the checkpoint of iteration 1 is committed, then kills the process of rank 1 from outside.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from stages.floor.locations import ckpt_stage, list_checkpoints
from tests.reliability.conftest import Pipeline, attempts, finish
from verl_core.store import ArtifactStore

RUN = "spmd-kill"
SPMD = [
    "trainer.n_gpus_per_node=2",
    "actor.strategy=fsdp2",
    "critic.strategy=fsdp2",
    "rollout.share_weights=false",
]
COMMON = ["sft.enable=false", "trainer.total_iterations=4", "trainer.save_freq=1", "export.enable=false"]


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc: parent links)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry.name)] = int(fields[1])
    out, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        children = [c for c, pp in parent.items() if pp == p]
        out += children
        frontier += children
    return out


def _rank_pid(root: int, rank: int) -> int | None:
    for pid in _descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"flows.spmd" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    return None


@pytest.mark.slow
def test_killed_rank_fails_the_job_and_one_process_resumes(pipeline: Pipeline, tmp_path: Path) -> None:
    store_url = str(tmp_path / "store")
    store = ArtifactStore(store_url)
    env = {"OMP_NUM_THREADS": "1"}
    proc = pipeline.start(store_url, RUN, overrides=[*COMMON, *SPMD], env=env)
    t0 = time.perf_counter()
    victim = None
    while time.perf_counter() - t0 < 300 and proc.poll() is None:
        if store.committed(RUN, ckpt_stage(1)) is not None:
            victim = _rank_pid(proc.pid, 1)
            if victim is not None:
                break
        time.sleep(0.2)
    assert victim is not None, f"no checkpoint of iteration 1 / no rank 1 (exit {proc.poll()})"
    os.kill(victim, signal.SIGKILL)
    killed_at = time.perf_counter()
    result = finish(proc, t0, timeout=180)
    failed_after = time.perf_counter() - killed_at
    print(f"the job failed {failed_after:.1f} s after rank 1 was killed")
    assert result.returncode != 0
    assert "rank 1 failed with exit code -9" in result.output, result.output[-4000:]
    assert failed_after < 120  # torchrun stops the other rank at once: nobody waits for a collective

    # nothing half-written is visible: every committed stage has all of its files
    committed = store.list_manifests(RUN)
    assert all(store.files_present(m) for m in committed)
    before = attempts(store_url, RUN)
    last = list_checkpoints(store, RUN)[-1]
    assert 1 <= last < 4

    # one process resumes from that checkpoint and finishes the plan, running no committed stage again
    rerun = pipeline.run(store_url, RUN, overrides=COMMON, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.output[-4000:]
    assert f"resumed from checkpoint at iteration {last}" in rerun.output
    after = attempts(store_url, RUN)
    assert {s: a for s, a in after.items() if s in before} == before
    assert list_checkpoints(store, RUN)[-1] == 4
