"""Run leases on memory://, a local directory and S3 (moto): an expired holder is taken over and can
no longer renew; a release deletes only our own lease; a write whose answer was lost (reset after S3
applied it, then retried) is recognised as ours; stores without conditional writes are refused; a
revoked stage lease stops its holder; a stage holder given up is fenced off (its heartbeat interrupts
the main thread, a late start is refused).
Refusal, dead-pid takeover, renewal and re-entrancy: tests/reliability/test_isolation.py; the
two-process race: tests/reliability/test_lease_race.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from tests.reliability.fault_proxy import FaultProxy
from verl_core.errors import ConfigError
from verl_core.store import ArtifactStore
from verl_core.store.lease import (
    STAGE_LEASE,
    RunInUseError,
    RunLease,
    StageRevokedError,
    acquire_run_lease,
    fence_stage_holder,
    read_lease,
    revoke_lease,
    revoked_holders,
    stage_heartbeat,
)


def test_an_expired_holder_is_taken_over_and_cannot_renew(store: ArtifactStore) -> None:
    stalled = RunLease(store, "r", ttl_s=0.3)
    stalled.acquire()
    stalled._stop.set()  # hung: no more renewals
    with pytest.raises(RunInUseError, match=f"in use by pid {os.getpid()} "):
        RunLease(store, "r", ttl_s=60).acquire()  # still within its TTL
    time.sleep(0.35)
    taker = RunLease(store, "r", ttl_s=60)
    taker.acquire()
    assert not stalled.renew()  # its ETag / version is stale: refused
    current = taker.read()
    assert current is not None and current.holder == taker.token
    taker.release()


def test_a_release_does_not_delete_someone_elses_lease(store: ArtifactStore) -> None:
    first = RunLease(store, "r", ttl_s=60)
    first.acquire()
    first._stop.set()
    # another process takes it over (as it would after the TTL) with a conditional replace
    found = first.cas.read(first.path)
    assert found is not None
    other = {"holder": "other", "host": "elsewhere", "pid": 1, "acquired_at": 0.0, "expires_at": 1e10}
    assert first.cas.replace(first.path, json.dumps(other).encode(), found.version) is not None
    first.release()
    current = first.read()
    assert current is not None and current.holder == "other"


@pytest.mark.s3
def test_a_write_whose_answer_was_lost_is_recognised(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # seed 21 with rate 0.5 resets the 1st and 3rd PUT after S3 applied them (create, renewal); their
    # retries (2nd, 4th) fail their condition, since the first attempt already changed the object
    with FaultProxy(
        os.environ["AWS_ENDPOINT_URL_S3"], rate=0.5, seed=21, kinds=("reset-after",), methods=("PUT",)
    ) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        lease = RunLease(ArtifactStore(f"{s3_bucket}/team"), "r", ttl_s=60)
        lease.acquire()
        assert lease.renew()
        lease.release()
        assert lease.read() is None
    assert proxy.counts == {"reset-after": 2}


def test_a_store_without_conditional_writes_holds_no_lease() -> None:
    with pytest.raises(ConfigError, match="offers no conditional write"):
        acquire_run_lease(ArtifactStore("nocas://runs"), "r", ttl_s=60)


def test_a_revoked_stage_lease_stops_its_holder(store: ArtifactStore) -> None:
    # a dispatched stage flow run's lease: its own object beside the run's lease, its flow run id as
    # holder; the dispatcher revokes it at the version it read and the holder's next renewal calls on_lost
    lost = threading.Event()
    run_lease = RunLease(store, "r", ttl_s=60)
    run_lease.acquire()
    stage = RunLease(store, "r", ttl_s=0.3, name=STAGE_LEASE, token="flow-run-1", on_lost=lost.set)
    stage.acquire()  # a second lease of the same run: no conflict with the run's own
    found = read_lease(store, "r", STAGE_LEASE)
    assert found is not None and found[0] is not None and found[0].holder == "flow-run-1"
    assert not revoke_lease(store, "r", STAGE_LEASE, "not-its-version")  # moved on: kept
    found = read_lease(store, "r", STAGE_LEASE)  # renewals move the version: read it again
    assert found is not None
    while not revoke_lease(store, "r", STAGE_LEASE, found[1]):
        found = read_lease(store, "r", STAGE_LEASE)  # renewed meanwhile (every 0.1 s)
        assert found is not None
    assert lost.wait(2)  # within one renewal period (0.1 s) on memory/local; S3 round trips slower
    assert read_lease(store, "r", STAGE_LEASE) is None
    current = run_lease.read()
    assert current is not None and current.holder == run_lease.token  # the run's lease untouched
    stage.release()
    run_lease.release()


def test_a_revoked_holder_is_interrupted_with_sigint_ignored(store: ArtifactStore) -> None:
    # a worker started in the background by a shell (`prefect worker start ... &`) has SIGINT ignored,
    # and so do its flow runs: the heartbeat's interrupt must still reach the main thread, and the
    # ignored SIGINT comes back after the block
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), stage_heartbeat(store, "r", "fr-1", 0.3):
            fence_stage_holder(store, "r", "fr-1")
            for _ in range(200):  # 10 s at most
                time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_stage_holder_given_up_is_fenced_off(store: ArtifactStore) -> None:
    # the dispatcher gives up flow run fr-1 while it holds the stage lease (it was only slow): its lease
    # is revoked, its next renewal (every 0.1 s) calls on_lost and interrupts the main thread, and a
    # late start of it is refused; fr-2 is not
    lost = threading.Event()
    with pytest.raises(KeyboardInterrupt), stage_heartbeat(store, "r", "fr-1", 0.3, on_lost=lost.set):
        fence_stage_holder(store, "r", "fr-1")
        for _ in range(200):  # an interrupt lands between bytecodes: short sleeps, 10 s at most
            time.sleep(0.05)
    assert lost.is_set()
    refused = pytest.raises(StageRevokedError, match="fr-1: the pipeline gave it up as lost")
    with refused, stage_heartbeat(store, "r", "fr-1", 0.3):
        raise AssertionError("a revoked holder's start must not get here")
    assert read_lease(store, "r", STAGE_LEASE) is None  # the refused start let its lease go
    with stage_heartbeat(store, "r", "fr-2", 0.3):
        found = read_lease(store, "r", STAGE_LEASE)
        assert found is not None and found[0] is not None and found[0].holder == "fr-2"
    fence_stage_holder(store, "r", "fr-2")  # a second loss: both stay revoked
    assert revoked_holders(store, "r") == ["fr-1", "fr-2"]
