"""The Prefect server a run talks to (``PREFECT_API_URL``, local mode) goes away mid-run. The tiny
pipeline is held at a point of the RL loop (``runner.py --pause-at``, released by a file); the server
is killed with SIGKILL there, the run released, and:

* the server gone for longer than the retries (``PREFECT_CLIENT_MAX_RETRIES=1`` here, so that "longer"
  is a few seconds; held before iteration 1's reward manifest): the run fails with one line naming
  the server and what to do, nothing half-committed;
* the server back, the same command resumes; held again while writing the final checkpoint, the
  server is killed and back on the same port and database 3 s later, within Prefect's client retries
  (a restart): the run goes on, redoes no committed stage and ends exactly as an uninterrupted run.

One run and its rerun serve both cases (a run of its own each would cost a minute more).

Deployments mode through a restart: tests/flows/test_deployments.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prefect_server import wait_healthy
from tests.reliability.conftest import Pipeline, Reference, attempts, fingerprint, finish, free_port


class Server:
    """A Prefect server on a fixed port and home (its sqlite database), killed and started again."""

    def __init__(self, home: Path) -> None:
        self.home, self.port = home, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_API_URL": "",
        }
        prefect = str(Path(sys.executable).parent / "prefect")
        args = ["server", "start", "--host", "127.0.0.1", "--port", str(self.port), "--analytics-off"]
        with open(self.home / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [prefect, *args],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        wait_healthy(self.api, proc=self.proc, log=self.home / "server.log")

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    home = tmp_path / "prefect-home"
    home.mkdir()
    s = Server(home)
    s.start()
    try:
        yield s
    finally:
        if s.proc is not None and s.proc.poll() is None:
            s.kill()


def _held_run(
    server: Server, tmp_path: Path, store_url: str, run: str, point: str, env: dict[str, str]
) -> subprocess.Popen[str]:
    """The tiny pipeline against ``server``, held at ``point`` (runner.py's) until ``{point}.release``."""
    marker, release = tmp_path / f"{point}.held", tmp_path / f"{point}.release"
    env = {**env, "RELIABILITY_MARKER": str(marker), "RELIABILITY_RELEASE": str(release)}
    proc = Pipeline(server.api, server.home).start(store_url, run, pause_at=point, env=env)
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None, f"run ended before the hold point:\n{proc.communicate()[1][-4000:]}"
        assert time.monotonic() < deadline, f"the run did not reach {point}"
        time.sleep(0.3)
    return proc


def test_a_run_fails_in_one_line_when_the_server_is_gone_and_resumes_through_a_restart(
    server: Server, reference: Reference, tmp_path: Path
) -> None:
    # an outage longer than the client's retries: one line, nothing half-committed
    store_url, run = str(tmp_path / "store"), "outage"
    proc = _held_run(server, tmp_path, store_url, run, "before-manifest", {"PREFECT_CLIENT_MAX_RETRIES": "1"})
    server.kill()
    held = attempts(store_url, run)
    (tmp_path / "before-manifest.release").touch()
    r = finish(proc, time.perf_counter())
    assert r.returncode == 1, r.output[-4000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-4000:]
    assert (
        f"the Prefect API {server.api} (from the environment variable PREFECT_API_URL) stopped answering"
        in errors[0]
    )
    assert "rerun the same command to resume" in errors[0] and "Traceback" not in r.stderr
    failed = attempts(store_url, run)
    assert {s: failed[s] for s in held} == held  # what was committed before stays as it was
    fingerprint(store_url, run)  # every committed file matches its manifest

    # the server back, the same command resumes; a restart (killed, released, back 3 s later on the
    # same port and database) while it writes the final checkpoint is ridden out
    server.start()
    proc = _held_run(server, tmp_path, store_url, run, "checkpoint-save", {})
    server.kill()
    (tmp_path / "checkpoint-save.release").touch()
    time.sleep(3)
    server.start()
    again = finish(proc, time.perf_counter())
    assert again.returncode == 0, again.output[-4000:]
    after = attempts(store_url, run)
    assert {s: after[s] for s in failed} == failed  # nothing committed was redone
    assert fingerprint(store_url, run) == reference.fingerprint
