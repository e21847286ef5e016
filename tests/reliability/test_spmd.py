"""The tiny pipeline (``tests/reliability/tiny.yaml``) with its SFT and RL loop on 2 gloo ranks (FSDP2
actor and critic, an HF engine with its own synced copy of the weights):

* it completes as one Prefect flow run: rank 0's stages are task runs of the pipeline's flow runs, no
  other flow run appears; the deterministic stages are byte-identical to a one-process run's;
* a rank killed with SIGKILL mid-run fails the job within a bounded time with an error naming the
  rank, nothing half-written is visible, and a rerun of the same run id resumes from the last
  checkpoint on one process (a world size of 1, the single strategy).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from stages.floor.locations import ckpt_stage, list_checkpoints
from tests.reliability.conftest import Pipeline, Reference, attempts, fingerprint, finish
from verl_core.store import ArtifactStore

RUN = "spmd-kill"
SPMD = [
    "trainer.n_gpus_per_node=2",
    "actor.strategy=fsdp2",
    "critic.strategy=fsdp2",
    "rollout.share_weights=false",
]
DETERMINISTIC = ("preprocess", "template_pack")
COMMON = ["sft.enable=false", "trainer.total_iterations=4", "trainer.save_freq=1", "export.enable=false"]


@pytest.mark.slow
def test_two_ranks_run_the_pipeline_in_one_flow_run(
    pipeline: Pipeline, reference: Reference, tmp_path: Path
) -> None:
    store_url, run = str(tmp_path / "store"), "spmd-e2e"
    result = pipeline.run(store_url, run, overrides=SPMD, env={"OMP_NUM_THREADS": "1"}, timeout=400)
    assert result.returncode == 0, result.output[-4000:]
    ours = fingerprint(store_url, run)
    deterministic = {k: v for k, v in reference.fingerprint.items() if k.split("/")[0] in DETERMINISTIC}
    assert deterministic and {k: ours.get(k) for k in deterministic} == deterministic
    tasks = _task_names(pipeline, run)
    # rank 0 ran the SFT stage and every RL stage as tasks of this run's flow runs
    assert {"sft_warmup", "init_rl_state", "rollout", "reward", "ppo_update", "checkpoint"} <= tasks


def _task_names(pipeline: Pipeline, run_id: str) -> set[str]:
    """Names of the task runs under the pipeline flow run of ``run_id`` and its sub-flow runs; fails
    if any other flow run of that run id exists (a rank that started a flow run of its own)."""
    from prefect.client.orchestration import SyncPrefectClient

    def every(read: Any) -> list[Any]:  # the API pages by at most 200
        out: list[Any] = []
        while batch := read(limit=200, offset=len(out)):
            out += batch
        return out

    with SyncPrefectClient(pipeline.api_url) as client:
        flows, tasks = every(client.read_flow_runs), every(client.read_task_runs)
    top = [f for f in flows if f.parameters.get("run_id") == run_id]
    assert len(top) == 1, [f.name for f in top]
    mine, frontier = {top[0].id}, [top[0].id]
    while frontier:  # sub-flows: flow runs whose parent task run belongs to one of ours
        parent = frontier.pop()
        owned = {t.id for t in tasks if t.flow_run_id == parent}
        children = [f.id for f in flows if f.parent_task_run_id in owned]
        mine.update(children)
        frontier += children
    by_ctx = [f for f in flows if f.id not in mine and run_id in str(f.parameters)]
    assert not by_ctx, f"flow runs outside the pipeline's: {[f.name for f in by_ctx]}"
    return {t.name.rsplit("-", 1)[0] for t in tasks if t.flow_run_id in mine}


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
        if f"RANK={rank}".encode() in env and b"launcher.spmd" in Path(f"/proc/{pid}/cmdline").read_bytes():
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
    kept = [s for s in after if s in before]  # old checkpoints are pruned (max_ckpt_to_keep)
    assert kept and {s: after[s] for s in kept} == {s: before[s] for s in kept}
    assert list_checkpoints(store, RUN)[-1] == 4
