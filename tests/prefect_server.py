"""Shared by the tests that start a real Prefect server on 127.0.0.1: a free port, the environment of
the server and of its clients and workers (a temporary ``PREFECT_HOME``, the API URL), the processes a
test starts (:class:`Processes`: each in a session of its own, stopped by its group id), the server's
start until it answers (:func:`wait_healthy`), the API's JSON and a flow run's state.

:func:`prefect_server` is the whole set-up: a server on a free port for the ``with`` block, every
process started through its :class:`Processes` stopped at the end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, NamedTuple

REPO = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}  # a flow run's state types that are final


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(
    api_url: str, timeout: float = 120.0, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None
) -> None:
    """Return once ``{api_url}/health`` answers ``true``; raise if ``proc`` (the server) exits first or
    ``timeout`` seconds pass, with the tail of ``log`` (the server's output) in the message."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
                if r.read().strip() == b"true":
                    return
        except OSError:
            pass
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"Prefect server at {api_url} not healthy after {timeout:g} s: {tail}")
        time.sleep(0.5)


def _api(api: str, path: str, body: dict[str, Any]) -> Any:
    """POST ``body`` as JSON to ``{api}{path}``; the answer's JSON."""
    req = urllib.request.Request(
        f"{api}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _state(api: str, flow_run_id: str) -> str | None:
    """The flow run's state type, None while the API does not answer (the server restarting)."""
    try:
        with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}", timeout=10) as r:
            return str(json.loads(r.read())["state_type"])
    except OSError:
        return None


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Processes:
    """Processes started by a test, each in its own session so that its group id is its PID and
    stopping it also stops the flow-run processes a worker spawned. Each writes ``{logs}/{name}.log``."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.started: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []
        self.by_name: dict[str, subprocess.Popen[bytes]] = {}
        self.how: dict[str, tuple[tuple[str, ...], dict[str, str] | None]] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Path:
        log = self.logs / f"{name}.log"
        f = log.open("ab")  # a restarted process goes on in its log
        p = subprocess.Popen(
            args, cwd=REPO, env={**self.env, **(env or {})}, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self.started.append((p, f))
        self.by_name[name] = p
        self.how[name] = (args, env)
        return log

    def start_server(self, port: int, api: str) -> None:
        """A Prefect API server on ``port`` (as ``server``), returned once ``api`` answers."""
        host = ("--host", "127.0.0.1", "--port", str(port), "--analytics-off")
        self.start("server", str(BIN / "prefect"), "server", "start", *host)
        wait_healthy(api, 90)

    def restart(self, name: str) -> None:
        """Kill ``name`` with SIGKILL (its whole tree) and start it again as it was started."""
        self.kill_tree(name)
        args, env = self.how[name]
        self.start(name, *args, env=env)

    def kill_tree(self, name: str) -> None:
        """SIGKILL a process and every descendant at once (a preempted machine: no cleanup anywhere)."""
        root = self.by_name[name]
        pids = [root.pid, *_descendants(root.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        root.wait(timeout=10)

    def stop_all(self) -> None:
        for p, _ in reversed(self.started):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p, f in reversed(self.started):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # workers may ignore SIGTERM for a while
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            f.close()


def server_env(root: Path, api: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a server at ``api`` and of its clients and workers: ``base`` (default: this
    process's) with ``PREFECT_HOME`` under ``root`` (the server's database, the clients' profile), the
    API URL, analytics off, and INFO logs (tests/conftest.py sets WARNING; a run's loggers send INFO
    lines to the API, where tests read them)."""
    return {
        **(os.environ if base is None else base),
        "PREFECT_HOME": str(root / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
    }


WORKER_ENV = {"PREFECT_WORKER_QUERY_SECONDS": "1"}  # a process worker polls its pool every second


class Server(NamedTuple):
    env: dict[str, str]  # for every process that talks to the server
    procs: Processes  # its ``server`` and whatever the test starts; their logs in the root
    api: str  # http://127.0.0.1:PORT/api


@contextlib.contextmanager
def prefect_server(
    root: Path, base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None
) -> Iterator[Server]:
    """A Prefect server on a free 127.0.0.1 port with its home under ``root``, healthy, for the block;
    ``extra`` is added to :func:`server_env`. Every process started through ``procs`` is stopped after."""
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**server_env(root, api, base), **(extra or {})}
    procs = Processes(env, root)
    try:
        procs.start_server(port, api)
        yield Server(env, procs, api)
    finally:
        procs.stop_all()
