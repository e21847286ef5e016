"""Run leases: at most one live process writes a run.

The lease is one small object in the store, ``runs/{run_id}/lease.json``: who holds it (a random
token, host, pid) and until when. Every write of it is conditional (:mod:`verl_core.store.cas`), so of
any number of processes starting the same run id at once, on one machine or many, exactly one wins:

1. a process that starts a run reads the lease. None there: it *creates* it (create-if-absent); a
   lease held by someone else, not expired and (same host) by a live process: the start is refused
   with :class:`RunInUseError` naming the holder; expired, or its holder's pid dead on this host: it
   *replaces* it if it is still the version it read (takeover). A failed condition means another
   starter got there first: it reads again and is refused (or takes over if that one is gone too);
2. the holder renews the lease every ``ttl_s / 3`` from a daemon thread, again only if it is still
   the version it last wrote: a holder whose lease was taken over stops renewing and logs it;
3. when the run ends it deletes the lease, only if it is still its own version.

Guaranteed on ``s3://`` (``If-None-Match: *`` / ``If-Match: <etag>`` on PUT and DELETE), local and
shared file systems (hard-link create, lock-file compare-and-swap) and ``memory://`` (one process);
any other store is refused with a ConfigError at the first lease. A PUT whose answer was lost and
that botocore retried shows up as a failed condition: the lease recognises its own token when it
reads the object back. Deployments (``execution.mode=deployments``) hold the same lease: the pipeline
flow takes it in ``start_run`` wherever it runs, and the stage flows it dispatches write under it.

A holder killed with ``kill -9`` leaves its lease behind: on the same host it is taken over at once
(the pid is dead), from another host after ``ttl_s`` at most - a crashed holder never blocks a run id
for ever. Within one process the lease is re-entrant (reference counted), so a flow may be called
twice in a row, e.g. by tests. Expiry compares wall clocks: hosts must agree to well within ``ttl_s``.

A stage flow run dispatched to a worker (``execution.mode=deployments``) holds a second lease of the
run, :data:`STAGE_LEASE`, with its flow run id as the holder, for its whole length
(:func:`stage_heartbeat`): its renewals are the heartbeat by which the dispatching pipeline tells a
live stage from one whose worker was preempted (:mod:`flows.dispatch`). Before dispatching the stage
again the pipeline fences the one it gave up (:func:`fence_stage_holder`): its flow run id goes on the
run's revoked list (:data:`REVOKED`; a late start of it stops at once) and its stage lease is revoked
(:func:`revoke_lease`; a holder that was only slow stops at its next renewal: the main thread is
interrupted) instead of writing beside its successor.
"""

from __future__ import annotations

import _thread
import json
import logging
import os
import posixpath
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from verl_core.errors import VerlFlowError
from verl_core.store.cas import Versioned, conditional_writes
from verl_core.store.store import ArtifactStore

LEASE = "lease.json"
STAGE_LEASE = "stage-lease.json"  # held by a stage flow run dispatched to a worker (flows.dispatch)
REVOKED = "stage-revoked.json"  # stage holders of the run given up as lost: a late start of one stops
log = logging.getLogger(__name__)


class RunInUseError(VerlFlowError):
    """Another live process holds the run's lease."""


class StageRevokedError(VerlFlowError):
    """A stage flow run started after the dispatcher had given it up (:func:`fence_stage_holder`)."""


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    host: str
    pid: int
    acquired_at: float
    expires_at: float

    def describe(self) -> str:
        since, until = _iso(self.acquired_at), _iso(self.expires_at)
        return f"pid {self.pid} on {self.host} (since {since}, lease until {until})"


class RunLease:
    """The lease of ``run_id`` in ``store`` for this process (see the module docstring)."""

    def __init__(
        self,
        store: ArtifactStore,
        run_id: str,
        ttl_s: float,
        *,
        name: str = LEASE,
        token: str | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        """``name``: the lease's object under the run (another name is another lease, e.g. a
        dispatched stage flow run's :data:`STAGE_LEASE`); ``token``: the holder's id (default random);
        ``on_lost``: called from the renewal thread when the lease was taken over or revoked."""
        self.store, self.run_id, self.ttl_s = store, run_id, ttl_s
        self.path = posixpath.join(store.run_dir(run_id), name)
        self.cas = conditional_writes(store.fs, store.url)  # refuses a store without conditional writes
        self.token = token or uuid.uuid4().hex
        self.on_lost = on_lost
        self.version: str | None = None  # of the lease as this process last wrote it
        self._acquired_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> LeaseRecord | None:
        found = self.cas.read(self.path)
        return _parse(found) if found else None

    def acquire(self) -> None:
        """Take the lease or raise :class:`RunInUseError` naming the holder."""
        self._acquired_at = time.time()
        current: LeaseRecord | None = None
        for _ in range(3):  # each failed condition means another process wrote the lease meanwhile
            found = self.cas.read(self.path)
            current = _parse(found) if found else None
            if found is None:
                self.version = self.cas.create(self.path, self._record())
            elif current is not None and current.holder == self.token:
                self.version = found.version  # our last write went through, its answer was lost
            elif current is not None and _alive(current):
                raise RunInUseError(self._refusal(current))
            else:
                self.version = self.cas.replace(self.path, self._record(), found.version)
                what = current.describe() if current else "an unreadable lease"
                if self.version is not None:
                    log.warning("run %s: lease of %s lapsed, took it over", self.run_id, what)
            if self.version is not None:
                break
        else:
            raise RunInUseError(
                self._refusal(current) if current else f"run {self.run_id!r}: lost the lease race"
            )
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{self.run_id}", daemon=True)
        self._thread.start()

    def renew(self) -> bool:
        """Push the expiry ``ttl_s`` ahead if the lease is still ours; False if it was taken over."""
        assert self.version is not None, "renew() before acquire()"
        record = self._record()
        version = self.cas.replace(self.path, record, self.version)
        if version is None and (found := self._ours()) is not None:  # a write of ours lost its answer
            same = found.data == record  # this one (then it is done) or an earlier one
            version = found.version if same else self.cas.replace(self.path, record, found.version)
        if version is not None:
            self.version = version
        return version is not None

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.version is None:
            return
        deleted = self.cas.delete(self.path, self.version)
        if not deleted and (found := self._ours()) is not None:
            deleted = self.cas.delete(self.path, found.version)
        if not deleted:
            log.warning("run %s: the lease is no longer ours, left in place", self.run_id)
        self.version = None

    def _ours(self) -> Versioned | None:
        """The lease as it is now, if it carries our token."""
        found = self.cas.read(self.path)
        current = _parse(found) if found else None
        return found if current is not None and current.holder == self.token else None

    def _record(self) -> bytes:
        now = time.time()
        record = LeaseRecord(self.token, _host(), os.getpid(), self._acquired_at, now + self.ttl_s)
        return json.dumps(asdict(record), indent=2).encode()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.renew():
                    continue
                current = self.read()
                if current is not None and current.holder == self.token:
                    continue  # still ours (a renewal lost its answer twice): again at the next beat
                holder = current.describe() if current else "nobody (deleted)"
                log.error("run %s: lease taken over by %s; renewal stopped", self.run_id, holder)
                if self.on_lost is not None:
                    self.on_lost()
                return
            except Exception as e:  # a flaky store: try again at the next beat, the TTL has slack
                log.warning("run %s: could not renew the lease (%s)", self.run_id, e)

    def _refusal(self, holder: LeaseRecord) -> str:
        return (
            f"run {self.run_id!r} is in use by {holder.describe()}; wait for it to finish, or use "
            f"another --run-id (a crashed holder's lease lapses after at most {self.ttl_s:g} s)"
        )


_HELD: dict[tuple[str, str], tuple[RunLease, int]] = {}
_HELD_LOCK = threading.Lock()


def acquire_run_lease(store: ArtifactStore, run_id: str, ttl_s: float) -> RunLease:
    """Hold ``run_id``'s lease for this process (re-entrant); raises :class:`RunInUseError`."""
    key = (store.url, run_id)
    with _HELD_LOCK:
        if key in _HELD:
            lease, count = _HELD[key]
            _HELD[key] = (lease, count + 1)
            return lease
        lease = RunLease(store, run_id, ttl_s)
        lease.acquire()
        _HELD[key] = (lease, 1)
        return lease


def release_run_lease(store_url: str, run_id: str) -> None:
    """Drop one hold of the lease; the last one deletes it. Unknown leases are ignored."""
    key = (store_url, run_id)
    with _HELD_LOCK:
        if key not in _HELD:
            return
        lease, count = _HELD.pop(key)
        if count > 1:
            _HELD[key] = (lease, count - 1)
            return
    lease.release()


def read_lease(store: ArtifactStore, run_id: str, name: str = LEASE) -> tuple[LeaseRecord | None, str] | None:
    """The lease ``name`` of ``run_id`` as it is now: its record (None if unreadable) and version, or
    None when nobody holds it."""
    found = conditional_writes(store.fs, store.url).read(posixpath.join(store.run_dir(run_id), name))
    return (_parse(found), found.version) if found else None


def revoke_lease(store: ArtifactStore, run_id: str, name: str, version: str) -> bool:
    """Delete the lease ``name`` if it is still at ``version`` (the holder's next renewal fails and
    it stops, see ``on_lost``); False when it moved on meanwhile."""
    path = posixpath.join(store.run_dir(run_id), name)
    return conditional_writes(store.fs, store.url).delete(path, version)


@contextmanager
def stage_heartbeat(
    store: ArtifactStore, run_id: str, holder: str, ttl_s: float, on_lost: Callable[[], None] | None = None
) -> Iterator[None]:
    """The heartbeat of a dispatched stage flow run ``holder`` (its flow run id): hold the run's
    :data:`STAGE_LEASE`, renewed every ``ttl_s / 3``, for the ``with`` block. A holder the dispatcher
    gave up already is refused at once (:class:`StageRevokedError`); one given up meanwhile (its lease
    revoked) calls ``on_lost`` and interrupts the main thread (a ``KeyboardInterrupt`` there), so a
    stage that was only slow stops instead of writing beside the one dispatched after it."""

    def lost() -> None:
        if on_lost is not None:
            on_lost()
        _thread.interrupt_main()

    lease = RunLease(store, run_id, ttl_s, name=STAGE_LEASE, token=holder, on_lost=lost)
    lease.acquire()
    try:
        check_not_revoked(store, run_id, holder)
        with _interruptible():
            yield
    finally:
        lease.release()


@contextmanager
def _interruptible() -> Iterator[None]:
    """SIGINT handled by Python in the main thread for the block, so that ``_thread.interrupt_main``
    reaches it: that call does nothing while SIGINT is ignored, and a process started in the
    background by a non-interactive shell (``prefect worker start … &``) has SIGINT ignored and passes
    that on to its children (the worker's flow runs). A handler of the process's own is left alone."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) not in (
        signal.SIG_IGN,
        signal.SIG_DFL,
    ):
        yield
        return
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def fence_stage_holder(store: ArtifactStore, run_id: str, holder: str) -> None:
    """Fence a stage holder the dispatcher gave up as lost or crashed: add it to the run's
    :data:`REVOKED` list (a late start of it stops at once, :func:`stage_heartbeat`), then revoke its
    stage lease if it holds it (a start that read the list just before stops at its next renewal)."""
    revoked = revoked_holders(store, run_id)
    if holder not in revoked:
        data = json.dumps({"revoked": [*revoked, holder]}, indent=2).encode()
        store.put_atomic(posixpath.join(store.run_dir(run_id), REVOKED), data)
    found = read_lease(store, run_id, STAGE_LEASE)
    if found is not None and found[0] is not None and found[0].holder == holder:
        revoke_lease(store, run_id, STAGE_LEASE, found[1])


def check_not_revoked(store: ArtifactStore, run_id: str, holder: str) -> None:
    """Raise :class:`StageRevokedError` if the dispatcher gave ``holder`` up (a start so late that it
    was declared lost and the stage dispatched again)."""
    if holder in revoked_holders(store, run_id):
        raise StageRevokedError(
            f"flow run {holder}: the pipeline gave it up as lost (no heartbeat within "
            "execution.start_timeout_s / lost_after_s) and dispatched the stage again; this late start stops"
        )


def revoked_holders(store: ArtifactStore, run_id: str) -> list[str]:
    """The stage holders of ``run_id`` the dispatcher gave up on (only the dispatcher writes the list)."""
    path = posixpath.join(store.run_dir(run_id), REVOKED)
    if not store.exists(path):
        return []
    return list(json.loads(store.cat(path))["revoked"])


def _parse(found: Versioned) -> LeaseRecord | None:
    """The lease record, or None when unreadable (then anyone may take it over)."""
    try:
        return LeaseRecord(**json.loads(found.data))
    except (ValueError, TypeError):
        return None


def _alive(record: LeaseRecord) -> bool:
    """Whether the holder may still be running: not expired and, on this host, its pid exists."""
    if record.expires_at < time.time():
        return False
    if record.host != _host():
        return True
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host() -> str:
    return os.uname().nodename


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")
