"""Run leases: at most one live process writes a run.

The lease is one small object in the store, ``runs/{run_id}/lease.json``: who holds it (a random
token, host, pid) and until when. A process that starts a run

1. reads the lease; a lease held by someone else, not expired, and (same host) by a live process
   refuses the start with :class:`RunInUseError`;
2. otherwise writes its own lease, waits ``settle_s`` and reads it back: if another starter's write
   came last, that one wins and this one is refused;
3. renews the lease every ``ttl_s / 3`` from a daemon thread, and deletes it when the run ends.

A holder killed with ``kill -9`` leaves its lease behind: on the same host it is taken over at once
(the pid is dead), from another host after ``ttl_s`` at most - a crashed holder never blocks a run id
for ever. Within one process the lease is re-entrant (reference counted), so a flow may be called
twice in a row, e.g. by tests.

Limit: object stores have no atomic compare-and-swap through fsspec, so two starters whose
read→write gaps both exceed ``settle_s`` could both win; ``settle_s`` (0.5 s) is far above a PUT's
latency, which is where that gap comes from.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from verl_core.errors import VerlFlowError
from verl_core.store.store import ArtifactStore

LEASE = "lease.json"
log = logging.getLogger(__name__)


class RunInUseError(VerlFlowError):
    """Another live process holds the run's lease."""


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

    def __init__(self, store: ArtifactStore, run_id: str, ttl_s: float, settle_s: float = 0.5) -> None:
        self.store, self.run_id, self.ttl_s, self.settle_s = store, run_id, ttl_s, settle_s
        self.path = posixpath.join(store.run_dir(run_id), LEASE)
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> LeaseRecord | None:
        if not self.store.exists(self.path):
            return None
        try:
            return LeaseRecord(**json.loads(self.store.cat(self.path)))
        except (ValueError, TypeError, FileNotFoundError):
            return None  # unreadable or deleted meanwhile: nobody holds it

    def acquire(self) -> None:
        """Take the lease or raise :class:`RunInUseError` naming the holder."""
        current = self.read()
        if current is not None and current.holder != self.token and _alive(current):
            raise RunInUseError(self._refusal(current))
        if current is not None and current.holder != self.token:
            log.warning("run %s: lease of %s lapsed, taking over", self.run_id, current.describe())
        self._write(acquired_at=time.time())
        time.sleep(self.settle_s)
        back = self.read()
        if back is None or back.holder != self.token:
            raise RunInUseError(self._refusal(back) if back else f"run {self.run_id!r}: lost the lease race")
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{self.run_id}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        current = self.read()
        if current is not None and current.holder == self.token:
            self.store.fs.rm(self.path)

    def _write(self, acquired_at: float) -> None:
        record = LeaseRecord(self.token, _host(), os.getpid(), acquired_at, time.time() + self.ttl_s)
        self.store.put_atomic(self.path, json.dumps(asdict(record), indent=2).encode())

    def _heartbeat(self) -> None:
        acquired = time.time()
        while not self._stop.wait(self.ttl_s / 3):
            try:
                current = self.read()
                if current is not None and current.holder != self.token:
                    log.error("run %s: lease taken over by %s", self.run_id, current.describe())
                    return
                self._write(acquired_at=current.acquired_at if current else acquired)
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
