"""Crash/resume: the tiny pipeline in a subprocess is killed with SIGKILL at one point after another
of the commit protocol, rerun each time with the same run id, and must end with exactly the
artifacts and policy tensors of an uninterrupted run, without ever running a committed stage again.

One chain of processes on one store (each kill point starts from where the previous one left off):

    preprocess-writes     killed after the prompt tables, before the SFT tables
    rollout-mid-artifact  half of rollouts.parquet written in place - then *paused* holding the run
                          lease: a second process on the same run id is refused, and the first is
                          killed from outside with SIGKILL (its lease is taken over at once)
    before-manifest       every data file of iteration 1's reward written, manifest not
    checkpoint-save       final checkpoint: policy and critic written, trainer state not
    pending-publish       checkpoint committed, the updates it covers not yet published
    export                export of the final policy: config files written, weights not
    (final run)           completes

The kill points are installed by ``runner.py`` around the store's write methods.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from tests.reliability.conftest import (
    Pipeline,
    Reference,
    attempts,
    fingerprint,
    finish,
    policy_tensors,
)
from verl_core.store import ArtifactStore

KILL_CHAIN = [
    "preprocess-writes",
    "rollout-mid-artifact",
    "before-manifest",
    "checkpoint-save",
    "pending-publish",
    "export",
]
RUN = "crashy"


def _uncommitted_files(store: ArtifactStore, stage: str) -> list[str]:
    """Files under a stage's directory (attempts of killed writers) while it has no manifest."""
    assert store.committed(RUN, stage) is None, f"{stage} must not be committed"
    stage_dir = store.path("runs", RUN, stage)
    return store.fs.find(stage_dir) if store.exists(stage_dir) else []


def _pause_refuse_and_kill(pipeline: Pipeline, store_url: str, tmp_path: Path) -> None:
    """rollout-mid-artifact: pause there holding the lease; a second process is refused; SIGKILL."""
    marker = tmp_path / "paused"
    t0 = time.perf_counter()
    first = pipeline.start(
        store_url, RUN, pause_at="rollout-mid-artifact", env={"RELIABILITY_MARKER": str(marker)}
    )
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert first.poll() is None, f"the first process ended early:\n{finish(first, t0).output[-4000:]}"
        assert time.monotonic() < deadline, "the first process never reached rollout-mid-artifact"
        time.sleep(0.2)
    second = pipeline.run(store_url, RUN)
    assert second.returncode == 1, second.output[-4000:]
    refusal = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(refusal) == 1, second.stderr[-4000:]
    assert f"run '{RUN}' is in use by pid {first.pid}" in refusal[0]
    assert "wait for it to finish, or use another --run-id" in refusal[0]
    os.kill(first.pid, signal.SIGKILL)  # a real kill -9 from outside
    assert finish(first, t0).returncode == -signal.SIGKILL


def test_killed_pipeline_resumes_to_the_uninterrupted_result(
    pipeline: Pipeline, reference: Reference, tmp_path: Path
) -> None:
    store_url = str(tmp_path / "store")
    store = ArtifactStore(store_url)
    committed: dict[str, str] = {}
    for point in KILL_CHAIN:
        if point == "rollout-mid-artifact":
            _pause_refuse_and_kill(pipeline, store_url, tmp_path)
        else:
            r = pipeline.run(store_url, RUN, kill_at=point)
            assert r.returncode == -signal.SIGKILL and r.killed_at() == point, r.output[-4000:]
        now = attempts(store_url, RUN)
        # no stage committed before this process started ran again: same attempt, same manifest
        assert {s: now.get(s) for s in committed} == committed, f"after {point}"
        fingerprint(store_url, RUN)  # every committed file still matches its manifest
        if point == "preprocess-writes":
            assert any("prompts/train.parquet" in p for p in _uncommitted_files(store, "preprocess"))
        elif point == "rollout-mid-artifact":
            assert any(p.endswith("rollouts.parquet") for p in _uncommitted_files(store, "iter-0000/rollout"))
        elif point == "before-manifest":
            assert any(p.endswith("rewards.parquet") for p in _uncommitted_files(store, "iter-0001/reward"))
            # the update of iteration 0 waits for a checkpoint: it was never committed
            assert store.committed(RUN, "iter-0000/update") is None
        elif point == "checkpoint-save":
            assert any("policy/" in p for p in _uncommitted_files(store, "ckpt/iter-0002"))
        elif point == "pending-publish":
            assert store.committed(RUN, "ckpt/iter-0002") is not None
            assert store.committed(RUN, "iter-0000/update") is None
        elif point == "export":
            assert any("config.json" in p for p in _uncommitted_files(store, "export/iter-0002"))
        committed = now

    final = pipeline.run(store_url, RUN)
    assert final.returncode == 0, final.output[-4000:]
    now = attempts(store_url, RUN)
    assert {s: now.get(s) for s in committed} == committed
    # the updates were published from the checkpoint's record, not computed again
    ckpt = store.committed(RUN, "ckpt/iter-0002")
    assert ckpt is not None and ckpt.summary["pending"] == ["iter-0000/update", "iter-0001/update"]
    assert set(now) == set(attempts(reference.store_url, "left"))
    assert fingerprint(store_url, RUN) == reference.fingerprint
    mine = policy_tensors(store_url, RUN, "ckpt/iter-0002")
    theirs = policy_tensors(reference.store_url, "left", "ckpt/iter-0002")
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    assert not store.exists(store.path("runs", RUN, "lease.json"))  # released at the end
