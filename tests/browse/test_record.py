"""browse.record: how a pipeline run finds a rollout browser open on its store (the record that
``verl-flow browse`` writes while it serves; its Prefect link artifact points at the page)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from browse.record import browser_url, records_dir, remove_record, write_record


@pytest.fixture(autouse=True)
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    return tmp_path


def test_a_live_record_gives_the_runs_page(state: Path) -> None:
    assert browser_url("/store", "r1") is None  # no browser ever ran
    path = write_record("http://127.0.0.1:8050", "/store", [])
    assert path.parent == records_dir() == state / "verl-flow" / "browsers"
    assert browser_url("/store", "r1") == "http://127.0.0.1:8050/run/r1"
    assert browser_url("/store", "a b") == "http://127.0.0.1:8050/run/a%20b"  # the id URL-quoted
    assert browser_url("/other-store", "r1") is None
    remove_record(path)
    assert browser_url("/store", "r1") is None


def test_a_browser_of_other_runs_or_a_dead_process_is_not_linked() -> None:
    write_record("http://127.0.0.1:8050", "/store", ["r2"])  # `verl-flow browse r2`
    assert browser_url("/store", "r1") is None and browser_url("/store", "r2") is not None
    os.remove(records_dir() / f"{os.getpid()}.json")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = {"url": "http://127.0.0.1:9", "store": "/store", "run_ids": [], "pid": int(gone.stdout)}
    (records_dir() / f"{dead['pid']}.json").write_text(json.dumps(dead))  # killed without cleaning up
    assert browser_url("/store", "r1") is None
