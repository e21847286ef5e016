"""The Prefect server a run talks to (``PREFECT_API_URL``, local mode) goes away mid-run. The tiny
pipeline is held at a point of the RL loop (``runner.py --pause-at before-manifest``, released by a
file); the server is killed with SIGKILL there, the run released, and:

* the server back on the same port within Prefect's client retries (a restart): the run goes on and
  ends exactly as an uninterrupted run;
* the server gone for longer than the retries (``PREFECT_CLIENT_MAX_RETRIES=1`` here, so that "longer"
  is a few seconds): the run fails with one line naming the server and what to do, nothing
  half-committed, and once the server is back the same command resumes without redoing a committed
  stage and ends exactly as an uninterrupted run.

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
    server: Server, tmp_path: Path, store_url: str, run: str, env: dict[str, str]
) -> subprocess.Popen[str]:
    """The tiny pipeline against ``server``, held before the manifest of iteration 1's reward."""
    marker, release = tmp_path / f"{run}.held", tmp_path / f"{run}.release"
    env = {**env, "RELIABILITY_MARKER": str(marker), "RELIABILITY_RELEASE": str(release)}
    proc = Pipeline(server.api, server.home).start(store_url, run, pause_at="before-manifest", env=env)
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None, f"run ended before the hold point:\n{proc.communicate()[1][-4000:]}"
        assert time.monotonic() < deadline, "the run did not reach the hold point"
        time.sleep(0.3)
    return proc


def test_a_run_goes_on_through_a_server_restart_and_resumes_after_a_longer_outage(
    server: Server, reference: Reference, tmp_path: Path
) -> None:
    # a restart: killed, released, back 3 s later on the same port and database
    store_url = str(tmp_path / "store")
    proc = _held_run(server, tmp_path, store_url, "restart", {})
    server.kill()
    (tmp_path / "restart.release").touch()
    time.sleep(3)
    server.start()
    r = finish(proc, time.perf_counter())
    assert r.returncode == 0, r.output[-4000:]
    assert fingerprint(store_url, "restart") == reference.fingerprint

    # an outage longer than the client's retries: one line, nothing half-committed
    store_url = str(tmp_path / "store-outage")
    proc = _held_run(server, tmp_path, store_url, "outage", {"PREFECT_CLIENT_MAX_RETRIES": "1"})
    server.kill()
    held = attempts(store_url, "outage")
    (tmp_path / "outage.release").touch()
    r = finish(proc, time.perf_counter())
    assert r.returncode == 1, r.output[-4000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-4000:]
    assert (
        f"the Prefect API {server.api} (from the environment variable PREFECT_API_URL) stopped answering"
        in errors[0]
    )
    assert "rerun the same command to resume" in errors[0] and "Traceback" not in r.stderr
    failed = attempts(store_url, "outage")
    assert {s: failed[s] for s in held} == held  # what was committed before stays as it was
    fingerprint(store_url, "outage")  # every committed file matches its manifest

    server.start()
    again = Pipeline(server.api, server.home).run(store_url, "outage")
    assert again.returncode == 0, again.output[-4000:]
    after = attempts(store_url, "outage")
    assert {s: after[s] for s in failed} == failed  # nothing committed was redone
    assert fingerprint(store_url, "outage") == reference.fingerprint
