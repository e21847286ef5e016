"""The lease race: two processes start the same run id at the same instant, 20 times; exactly one may
win each time. On S3 (moto) every PUT goes through a proxy that delays half of them (seeded) by more
than the old read-back settle time (0.5 s), which is what let both starters win before the leases
were conditional writes. Half of the trials race for a fresh run id (exclusive create), the other half
for one whose lease has expired (compare-and-swap takeover)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.conftest import REPO
from tests.reliability.fault_proxy import FaultProxy
from verl_core.store import ArtifactStore
from verl_core.store.lease import LEASE

TRIALS = 20
DELAY_S = 0.8  # > the old settle_s (0.5 s)
LEAD_S = 0.2  # the start instant is this far ahead of the moment both contenders are told


@contextmanager
def contenders(store_url: str, env: Mapping[str, str]) -> Iterator[list[subprocess.Popen[str]]]:
    """Two racer processes (``lease_racer.py``), connected to the store and ready."""
    full_env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "tests.reliability.lease_racer"]
    procs = [
        subprocess.Popen(
            cmd, cwd=REPO, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert json.loads(_readline(p)) == {"ready": True}
            _send(p, {"store": store_url})
        for p in procs:
            assert json.loads(_readline(p)) == {"ready": True}
        yield procs
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            p.wait(timeout=30)


def _send(proc: subprocess.Popen[str], message: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(message) + "\n")
    proc.stdin.flush()


def _readline(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"racer exited with {proc.wait(timeout=10)}"
    return line


def _expired_lease(store: ArtifactStore, run_id: str) -> None:
    now = time.time()
    record = {
        "holder": "gone",
        "host": "elsewhere",
        "pid": 1,
        "acquired_at": now - 300,
        "expires_at": now - 1,
    }
    store.put_atomic(store.path("runs", run_id, LEASE), json.dumps(record).encode())


def race(store_url: str, env: Mapping[str, str]) -> list[list[dict[str, Any]]]:
    """Run the trials; returns both answers of each trial."""
    store = ArtifactStore(store_url)
    outcomes = []
    with contenders(store_url, env) as procs:
        for i in range(TRIALS):
            run_id = f"race-{i}"
            if i % 2:
                _expired_lease(store, run_id)
            start_at = time.time() + LEAD_S
            for p in procs:
                _send(p, {"store": store_url, "run_id": run_id, "start_at": start_at})
            outcomes.append([json.loads(_readline(p)) for p in procs])
    return outcomes


def check_one_winner(outcomes: list[list[dict[str, Any]]], where: str) -> None:
    both = sum(all(a["won"] for a in answers) for answers in outcomes)
    none = sum(not any(a["won"] for a in answers) for answers in outcomes)
    print(f"\n{where}: both won in {both}, neither in {none} of {len(outcomes)} trials")
    for answers in outcomes:
        assert sorted(a["won"] for a in answers) == [False, True], answers
        loser = next(a for a in answers if not a["won"])
        assert loser["error"].startswith("RunInUseError: run 'race-"), loser


def test_exactly_one_of_two_simultaneous_starters_wins_on_a_local_store(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    check_one_winner(race(url, {}), "local")


@pytest.mark.s3
def test_exactly_one_of_two_simultaneous_starters_wins_on_s3_with_delayed_puts(s3_bucket: str) -> None:
    with ExitStack() as stack:
        proxy = stack.enter_context(
            FaultProxy(
                os.environ["AWS_ENDPOINT_URL_S3"],
                rate=0.5,
                seed=3,
                kinds=("delay",),
                delay_s=DELAY_S,
                methods=("PUT",),
            )
        )
        outcomes = race(f"{s3_bucket}/team", {"AWS_ENDPOINT_URL_S3": proxy.url})
    assert proxy.counts["delay"] >= TRIALS // 2, proxy.counts  # the delays did happen
    check_one_winner(outcomes, f"s3 ({proxy.counts['delay']} of {proxy.requests} requests delayed)")
