"""``verl-flow run`` through the real CLI in subprocesses: a failed run prints one line (stage,
iteration, what failed, the log file) and keeps Prefect's failure lines and tracebacks in the log
file (and the server's UI); ``infra/local/prefect_server.sh`` changes no Prefect profile; an
unreachable ``PREFECT_API_URL`` fails in one line before any work.

Every process gets a temporary PREFECT_HOME (the machine's ~/.prefect is never touched). The failure
tests share one server started by the helper script (a temporary server costs 10-20 s per process).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.prefect_server import wait_healthy

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "tests" / "reliability" / "tiny.yaml")
# the tiny pipeline with a reward function that raises: preprocess, template_pack and SFT commit,
# then iteration 0's reward stage fails (after its two task retries)
FAILING = ["reward.scorers=[function]", "reward.function=tests.data.bad.bad_rewards:raises"]
SMALLEST = ["trainer.total_iterations=1", "sft.max_steps=1", "export.enable=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(prefect_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(prefect_home),
        PREFECT_LOGGING_LEVEL="INFO",  # Prefect's state lines reach the console filter, not only warnings
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=str(REPO),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # the prefect of this environment
        COLUMNS="80",
        TERM="dumb",
        **extra,
    )
    return env


@dataclass
class Server:
    """``infra/local/prefect_server.sh`` running with its own PREFECT_HOME."""

    api_url: str
    home: Path
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    log = open(home / "server.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [str(REPO / "infra" / "local" / "prefect_server.sh"), str(port)],
        env=_env(home, PREFECT_UI_ENABLED="false"),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    srv = Server(f"http://127.0.0.1:{port}/api", home, proc)
    try:
        wait_healthy(srv.api_url, proc=proc, log=home / "server.log")
        yield srv
    finally:
        srv.stop()
        log.close()


def _verl_flow(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.search(r"\berror\b", line, re.IGNORECASE)]


def test_failed_run_prints_one_line_and_logs_the_traceback(server: Server, tmp_path: Path) -> None:
    env = _env(tmp_path / "prefect-home", PREFECT_API_URL=server.api_url)
    args = ["run", TINY, f"store.url={tmp_path / 'store'}", *FAILING, "--run-id", "broken"]
    r = _verl_flow(args, env, tmp_path)
    console = r.stdout + r.stderr
    assert r.returncode == 1, console[-4000:]
    errors = _error_lines(console)
    assert len(errors) == 1, console[-4000:]
    line = errors[0]
    assert line.startswith("error: stage reward, iteration 0: reward scorer 'function' failed"), line
    assert "RuntimeError: the grader's database is down" in line
    assert "Traceback" not in console
    assert "Finished in state Failed" not in console and "Retries are exhausted" not in console
    assert "Task run 'sft_warmup-" in console  # the progress lines stay on the console

    m = re.search(r"\(full log: (.+\.log)\)$", line)
    assert m, line
    log = Path(m.group(1))
    assert log.parent == tmp_path / "store" / "logs" / "broken"  # beside runs/, not in the run's dir
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "the grader's database is down" in text
    assert "Finished in state Failed" in text

    # the server (the UI) has the task's failure too
    req = urllib.request.Request(
        f"{server.api_url}/logs/filter", data=b"{}", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        messages = [entry["message"] for entry in json.load(resp)]
    assert any("Retries are exhausted" in msg and "database is down" in msg for msg in messages)

    # --verbose: Prefect's failure lines and the traceback on the console as well, then the same line
    v = _verl_flow([*args, "--verbose"], env, tmp_path)
    assert v.returncode == 1
    assert "Traceback (most recent call last)" in v.stderr and "Finished in state Failed" in v.stderr
    last = [ln for ln in v.stderr.splitlines() if ln.startswith("error:")]
    assert len(last) == 1 and last[0].startswith("error: stage reward, iteration 0:"), v.stderr[-3000:]


def test_server_helper_keeps_profiles_and_a_dead_api_url_fails_in_one_line(
    server: Server, tmp_path: Path
) -> None:
    # the helper changed no profile in its PREFECT_HOME (the old one ran `prefect config set`)
    profiles = server.home / "profiles.toml"
    assert not profiles.exists() or "PREFECT_API_URL" not in profiles.read_text()
    server.stop()
    dead = server.api_url
    home = server.home  # the same Prefect home the helper used: its default profile still works

    ok = _verl_flow(["run", TINY, f"store.url={tmp_path / 'store'}", *SMALLEST], _env(home), tmp_path)
    assert ok.returncode == 0, (ok.stdout + ok.stderr)[-4000:]
    assert "full log: " in ok.stdout

    t0 = time.perf_counter()
    r = _verl_flow(
        ["run", TINY, f"store.url={tmp_path / 'dead'}"], _env(home, PREFECT_API_URL=dead), tmp_path
    )
    console = r.stdout + r.stderr
    assert r.returncode == 1, console
    assert len(console.strip().splitlines()) == 1, console
    port = dead.split(":")[2].split("/")[0]
    assert console.strip() == (
        f"error: the Prefect API {dead} (from the environment variable PREFECT_API_URL) is not reachable "
        f"([Errno 111] Connection refused): start the server (`infra/local/prefect_server.sh {port}`), "
        "or run `unset PREFECT_API_URL` to use a temporary server started for the run"
    )
    assert not (tmp_path / "dead").exists()  # stopped before any work
    assert time.perf_counter() - t0 < 60


def test_a_dead_api_url_left_in_a_profile_names_the_profile_and_how_to_unset_it(tmp_path: Path) -> None:
    # issue 18's trap: an older helper wrote PREFECT_API_URL into the user's profile; once that server
    # stopped, every run failed in Prefect's traceback. Now: one line naming the profile and its fix.
    home = tmp_path / "prefect-home"
    home.mkdir()
    dead = f"http://127.0.0.1:{_free_port()}/api"  # nothing listens there
    profiles = home / "profiles.toml"
    profiles.write_text(f'active = "mine"\n\n[profiles.mine]\nPREFECT_API_URL = "{dead}"\n')
    r = _verl_flow(["run", TINY, f"store.url={tmp_path / 'store'}"], _env(home), tmp_path)
    console = (r.stdout + r.stderr).strip()
    assert r.returncode == 1, console
    assert console == (
        f"error: the Prefect API {dead} (from profile 'mine' in {profiles}) is not reachable "
        f"([Errno 111] Connection refused): start the server (`infra/local/prefect_server.sh "
        f"{dead.split(':')[2].split('/')[0]}`), or run `prefect --profile mine config unset "
        "PREFECT_API_URL` to use a temporary server started for the run"
    )
    assert not (tmp_path / "store").exists()  # stopped before any work
