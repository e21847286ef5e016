"""Isolation: two runs of the same config in parallel on one store end with identical, separate
artifacts and touch nothing of each other's; a run's lease refuses a second live process (the
subprocess case is in test_crash_resume: a paused run refuses a second CLI process), and a crashed
holder's lease is taken over - at once on the same host (dead pid), after its TTL from another."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.run_links import LINKS
from tests.reliability.conftest import Reference, fingerprint
from verl_core.store import ArtifactStore
from verl_core.store.lease import LEASE, RunInUseError, RunLease, acquire_run_lease, release_run_lease


def test_parallel_runs_on_one_store_never_touch_each_other(reference: Reference) -> None:
    store = ArtifactStore(reference.store_url)
    assert store.list_runs() == ["left", "right"]
    # same config, same seeds: interference of any kind would show as a difference
    assert fingerprint(reference.store_url, "right") == reference.fingerprint
    for run_id in ("left", "right"):
        run_dir = store.run_dir(run_id)
        allowed = {f"{run_dir}/run.json", f"{run_dir}/{LINKS}"}  # its records (flows.run_links)
        for m in store.list_manifests(run_id):
            assert m.run_id == run_id
            for name, ref in m.inputs.items():
                assert f"/runs/{run_id}/" in ref["uri"], f"{m.stage} input {name} is outside its run"
            allowed.add(f"{run_dir}/{m.stage}/manifest.json")
            allowed.update(f"{run_dir}/{m.stage}/{f.path}" for f in m.files)
        # every file under the run is its record, a manifest or a file its manifests list (no lease)
        assert sorted(set(store.fs.find(run_dir)) - allowed) == []
        assert store.read_run_record(run_id).run_id == run_id


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(str(tmp_path) if request.param == "local" else f"memory://lease-{tmp_path.name}")


def test_a_live_lease_refuses_another_holder(store: ArtifactStore) -> None:
    first = RunLease(store, "r", ttl_s=60)
    first.acquire()
    try:
        second = RunLease(store, "r", ttl_s=60)
        with pytest.raises(RunInUseError, match=r"^run 'r' is in use by pid \d+ on .* \(since .*lease until"):
            second.acquire()
        RunLease(store, "other", ttl_s=60).acquire()  # other run ids are free
    finally:
        first.release()
    assert not store.exists(store.path("runs", "r", LEASE))
    RunLease(store, "r", ttl_s=60).acquire()  # released: free again


def _write(store: ArtifactStore, run_id: str, **fields: object) -> None:
    record = {"holder": "someone", "host": "elsewhere", "pid": 1, "acquired_at": time.time()}
    record.update({"expires_at": time.time() + 60, **fields})
    store.put_atomic(store.path("runs", run_id, LEASE), json.dumps(record).encode())


def test_a_crashed_holder_does_not_block_for_ever(store: ArtifactStore) -> None:
    import os

    # same host, dead pid: taken over at once
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    _write(store, "same-host", host=os.uname().nodename, pid=int(dead.stdout))
    RunLease(store, "same-host", ttl_s=60).acquire()
    # another host, not expired: refused; expired: taken over
    _write(store, "remote", expires_at=time.time() + 60)
    with pytest.raises(RunInUseError, match="pid 1 on elsewhere"):
        RunLease(store, "remote", ttl_s=60).acquire()
    _write(store, "remote", expires_at=time.time() - 1)
    lease = RunLease(store, "remote", ttl_s=60)
    lease.acquire()
    assert lease.read() is not None and lease.read().holder == lease.token  # type: ignore[union-attr]


def test_the_lease_is_renewed_and_reentrant_in_one_process(store: ArtifactStore) -> None:
    lease = acquire_run_lease(store, "r", ttl_s=0.6)
    assert acquire_run_lease(store, "r", ttl_s=0.6) is lease  # a second flow call in this process
    first = lease.read()
    assert first is not None
    time.sleep(0.5)  # the heartbeat renews every ttl/3
    renewed = lease.read()
    assert renewed is not None and renewed.expires_at > first.expires_at
    assert dataclasses.replace(renewed, expires_at=0) == dataclasses.replace(first, expires_at=0)
    release_run_lease(store.url, "r")
    assert lease.read() is not None  # still held once
    release_run_lease(store.url, "r")
    assert lease.read() is None
