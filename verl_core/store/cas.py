"""Conditional writes of one small object: create-if-absent, replace-if-unchanged, delete-if-unchanged.

Each store that verl-flow can hold a run lease on (:mod:`verl_core.store.lease`) offers them natively:

* ``s3://`` (s3fs/botocore): a ``PutObject`` with ``If-None-Match: *`` creates, one with
  ``If-Match: <etag>`` replaces, a ``DeleteObject`` with ``If-Match`` deletes; S3 answers
  ``412 PreconditionFailed`` (or ``409 ConditionalRequestConflict``) when the condition fails. The
  version is the object's ETag.
* local and shared file systems (``file://``): a fully written temporary file is hard-linked to the
  path (``link`` fails if the path exists, atomically, also over NFS: an ``O_CREAT|O_EXCL`` create
  whose content appears at once); replace and delete compare the content under a lock file (itself
  an ``O_CREAT|O_EXCL`` create) and replace with ``os.replace``. A lock file left by a killed process
  (its pid gone on this host, or older than ``LOCK_STALE_S``) is broken. The version is the sha256
  of the content.
* ``memory://`` (tests, one process): a process-wide lock around read-compare-write.

Any other fsspec protocol has no compare-and-swap that verl-flow knows of: :func:`conditional_writes`
refuses it with a :class:`~verl_core.errors.ConfigError` rather than hold leases unsafely.

A request that was applied but whose answer was lost (a reset connection, then botocore's retry) comes
back as a failed condition; callers that put a unique token in their objects can tell it was theirs
by reading the object back (the lease does).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol

import fsspec
from fsspec.asyn import sync

from verl_core.errors import ConfigError

LOCK_STALE_S = 10.0  # a lock is held for one read-compare-replace (milliseconds); older is a dead holder
LOCK_WAIT_S = 15.0  # longer than LOCK_STALE_S: a stale lock is always broken before waiting gives up
log = logging.getLogger(__name__)


class Versioned(NamedTuple):
    data: bytes
    version: str  # the ETag on S3, the sha256 of ``data`` elsewhere


class ConditionalWrites(Protocol):
    """Compare-and-swap on one object of a store (paths are the store's filesystem paths)."""

    def read(self, path: str) -> Versioned | None:
        """The object and its version, or None when it does not exist."""

    def create(self, path: str, data: bytes) -> str | None:
        """Write ``data`` if nothing is at ``path``; the new version, or None if something was."""

    def replace(self, path: str, data: bytes, version: str) -> str | None:
        """Write ``data`` if ``path`` is still at ``version``; the new version, or None if not."""

    def delete(self, path: str, version: str) -> bool:
        """Delete ``path`` if it is still at ``version``; False if another version is there."""


def conditional_writes(fs: fsspec.AbstractFileSystem, url: str) -> ConditionalWrites:
    """The conditional writes of the filesystem ``fs`` of the store at ``url``; raises
    :class:`ConfigError` for a protocol that offers none."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & {"s3", "s3a"}:
        return S3Writes(fs)
    if "file" in protocols:
        return LocalWrites()
    if "memory" in protocols:
        return MemoryWrites(fs)
    raise ConfigError(
        f"store.url: {url!r} ({'/'.join(sorted(protocols))}) offers no conditional write that verl-flow "
        "knows, so a run lease on it could be held by two processes at once; use s3://, a local or "
        "shared file system path, or memory:// (tests)"
    )


# ------------------------------------------------------------------------------------------------ S3


class S3Writes:
    """Conditional PUT/DELETE through s3fs's botocore client (same endpoint, credentials, retries)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def read(self, path: str) -> Versioned | None:
        bucket, key, _ = self.fs.split_path(path)
        try:
            data, etag = sync(self.fs.loop, self._get, bucket, key)
        except FileNotFoundError:
            return None
        return Versioned(data, etag)

    async def _get(self, bucket: str, key: str) -> tuple[bytes, str]:
        resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
        body = resp["Body"]
        try:
            data = await body.read()
        finally:
            body.close()
        return data, resp["ETag"]

    def create(self, path: str, data: bytes) -> str | None:
        return self._put(path, data, IfNoneMatch="*")

    def replace(self, path: str, data: bytes, version: str) -> str | None:
        return self._put(path, data, IfMatch=version)

    def _put(self, path: str, data: bytes, **condition: str) -> str | None:
        bucket, key, _ = self.fs.split_path(path)
        try:
            resp = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except FileNotFoundError:  # If-Match on an object that is gone
            return None
        except OSError as e:
            if _condition_failed(e):
                return None
            raise
        self.fs.invalidate_cache(path)
        return str(resp["ETag"])

    def delete(self, path: str, version: str) -> bool:
        bucket, key, _ = self.fs.split_path(path)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
        except FileNotFoundError:
            return True  # already gone (or our retried delete had gone through)
        except OSError as e:
            if _condition_failed(e):
                return False
            if _error_code(e) not in ("NotImplemented", "InvalidArgument"):
                raise
            # an S3-compatible store without conditional deletes: compare, then delete
            log.warning("%s: the store refuses If-Match on DELETE; deleting after a read", path)
            current = self.read(path)
            if current is not None and current.version != version:
                return False
            self.fs.rm(path)
        self.fs.invalidate_cache(path)
        return True


def _error_code(e: BaseException) -> str | None:
    response = getattr(e.__cause__, "response", None) or {}
    code = response.get("Error", {}).get("Code")
    return str(code) if code is not None else None


def _condition_failed(e: OSError) -> bool:
    """s3fs maps 412 to FileExistsError (If-None-Match) or OSError(EINVAL), its cause the ClientError."""
    if isinstance(e, FileExistsError):
        return True
    status = (getattr(e.__cause__, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    return _error_code(e) in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


# ------------------------------------------------------------------------------------------------ local


class LocalWrites:
    """Hard-link creates and lock-file compare-and-swap on a local or shared (NFS) file system."""

    def read(self, path: str) -> Versioned | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return Versioned(data, _sha256(data))

    def create(self, path: str, data: bytes) -> str | None:
        tmp = _write_tmp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        finally:
            os.unlink(tmp)
        return _sha256(data)

    def replace(self, path: str, data: bytes, version: str) -> str | None:
        with _file_lock(f"{path}.lock"):
            current = self.read(path)
            if current is None or current.version != version:
                return None
            os.replace(_write_tmp(path, data), path)
        return _sha256(data)

    def delete(self, path: str, version: str) -> bool:
        with _file_lock(f"{path}.lock"):
            current = self.read(path)
            if current is not None and current.version != version:
                return False
            if current is not None:
                os.unlink(path)
        return True


def _write_tmp(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


@contextmanager
def _file_lock(lock: str) -> Iterator[None]:
    """Hold ``lock`` (an ``O_EXCL`` file naming this process) around a read-compare-replace."""
    body = json.dumps({"token": uuid.uuid4().hex, "host": os.uname().nodename, "pid": os.getpid()}).encode()
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if not _break_if_stale(lock) and time.monotonic() > deadline:
                raise TimeoutError(f"{lock}: held by a live process for over {LOCK_WAIT_S:g} s") from None
            time.sleep(0.005)
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        break
    try:
        yield
    finally:
        try:
            with open(lock, "rb") as f:
                ours = f.read() == body
            if ours:
                os.unlink(lock)
        except FileNotFoundError:  # broken as stale meanwhile (we stalled for LOCK_STALE_S)
            pass


def _break_if_stale(lock: str) -> bool:
    """Remove ``lock`` if its holder is dead (same host, pid gone) or it is older than LOCK_STALE_S.

    The lock is first renamed aside (only one breaker can rename it) and checked to still be the one
    judged stale; a fresh lock renamed by a breaker that raced another is linked back."""
    try:
        with open(lock, "rb") as f:
            judged = f.read()
        age = time.time() - os.stat(lock).st_mtime
    except FileNotFoundError:
        return True  # released meanwhile: try again
    if age <= LOCK_STALE_S and not _dead_holder(judged):
        return False
    aside = f"{lock}.stale-{uuid.uuid4().hex}"
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return True
    with open(aside, "rb") as f:
        taken = f.read()
    if taken != judged:  # another breaker replaced the stale lock meanwhile: that one is live
        try:
            os.link(aside, lock)
        except FileExistsError:
            log.warning("%s: a live lock was broken as stale by a concurrent breaker", lock)
    else:
        log.warning("%s: broke a stale lock (%s)", lock, judged.decode(errors="replace") or "empty")
    os.unlink(aside)
    return True


def _dead_holder(body: bytes) -> bool:
    try:
        holder = json.loads(body)
        host, pid = holder["host"], int(holder["pid"])
    except (ValueError, KeyError, TypeError):
        return False  # being written, or garbage: left to the age test
    if host != os.uname().nodename:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------------ memory

_MEMORY_LOCK = threading.Lock()


class MemoryWrites:
    """memory:// lives in one process: a process-wide lock makes read-compare-write atomic."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def read(self, path: str) -> Versioned | None:
        try:
            data = bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        return Versioned(data, _sha256(data))

    def create(self, path: str, data: bytes) -> str | None:
        with _MEMORY_LOCK:
            if self.fs.exists(path):
                return None
            self.fs.pipe_file(path, data)
        return _sha256(data)

    def replace(self, path: str, data: bytes, version: str) -> str | None:
        with _MEMORY_LOCK:
            current = self.read(path)
            if current is None or current.version != version:
                return None
            self.fs.pipe_file(path, data)
        return _sha256(data)

    def delete(self, path: str, version: str) -> bool:
        with _MEMORY_LOCK:
            current = self.read(path)
            if current is not None and current.version != version:
                return False
            if current is not None:
                self.fs.rm(path)
        return True
