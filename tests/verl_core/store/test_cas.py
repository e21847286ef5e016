"""Conditional writes: create-if-absent, replace and delete only at the version read, on memory://,
a local directory and S3 (moto enforces If-None-Match / If-Match); local lock files left by dead or
stalled holders are broken, a live one is waited for; other protocols are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_core.errors import ConfigError
from verl_core.store import ArtifactStore, cas
from verl_core.store.cas import LocalWrites, conditional_writes


def test_create_is_exclusive(store: ArtifactStore) -> None:
    writes, path = conditional_writes(store.fs, store.url), store.path("runs", "r", "obj.json")
    assert writes.read(path) is None
    first = writes.create(path, b"first")
    assert first is not None
    assert writes.create(path, b"second") is None  # something is there: refused
    assert writes.read(path) == (b"first", first)


def test_replace_and_delete_only_at_the_version_read(store: ArtifactStore) -> None:
    writes, path = conditional_writes(store.fs, store.url), store.path("runs", "r", "obj.json")
    assert writes.replace(path, b"x", "no-such-version") is None  # nothing there to replace
    v1 = writes.create(path, b"one")
    assert v1 is not None
    v2 = writes.replace(path, b"two", v1)
    assert v2 is not None and v2 != v1
    assert writes.replace(path, b"three", v1) is None  # stale version: refused
    assert not writes.delete(path, v1)  # stale version: left in place
    assert writes.read(path) == (b"two", v2)
    assert writes.delete(path, v2)
    assert writes.read(path) is None
    assert writes.delete(path, v2)  # already gone


def test_a_store_without_conditional_writes_is_refused() -> None:
    store = ArtifactStore("nocas://somewhere")
    with pytest.raises(ConfigError, match=r"^store.url: 'nocas://somewhere' \(nocas\) offers no conditional"):
        conditional_writes(store.fs, store.url)


def _lock(path: Path, host: str, pid: int, age_s: float = 0.0) -> Path:
    lock = Path(f"{path}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps({"token": "t", "host": host, "pid": pid}))
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_lock_file_of_a_killed_process_does_not_block(tmp_path: Path) -> None:
    path, writes = tmp_path / "obj.json", LocalWrites()
    v1 = writes.create(str(path), b"one")
    assert v1 is not None
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    lock = _lock(path, os.uname().nodename, int(dead.stdout))  # this host, pid gone: broken at once
    v2 = writes.replace(str(path), b"two", v1)
    assert v2 is not None
    _lock(path, "elsewhere", 1, age_s=cas.LOCK_STALE_S + 1)  # another host's, too old: broken
    assert writes.delete(str(path), v2)
    assert not lock.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_live_lock_file_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cas, "LOCK_WAIT_S", 0.2)
    path, writes = tmp_path / "obj.json", LocalWrites()
    v1 = writes.create(str(path), b"one")
    assert v1 is not None
    lock = _lock(path, os.uname().nodename, os.getpid())  # live and fresh: never broken
    with pytest.raises(TimeoutError, match="held by a live process"):
        writes.replace(str(path), b"two", v1)
    lock.unlink()
    assert writes.replace(str(path), b"two", v1) is not None
