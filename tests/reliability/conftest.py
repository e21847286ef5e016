"""Fixtures of the reliability suite: one Prefect server for every pipeline subprocess of the session
(instead of a 13-17 s temporary server per process), a runner for the tiny pipeline in a subprocess
(optionally killed at a named point, see ``runner.py``), and helpers that read a run's committed
artifacts. The S3-compatible endpoint is the session's moto server from ``tests/conftest.py``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import safetensors.torch
import torch

from flows.run_links import LINKS
from stages.floor.fingerprint import fingerprint
from tests.prefect_server import wait_healthy
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "tests" / "reliability" / "tiny.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def killed_at(self) -> str | None:
        """The kill point the runner reported (Prefect's ``log_prints`` may route it to the log)."""
        found = re.findall(r"KILLED-AT (\S+)", self.output)
        return found[-1] if found else None


@dataclass(frozen=True)
class Pipeline:
    """Runs ``verl-flow run tests/reliability/tiny.yaml`` in subprocesses against one Prefect server."""

    api_url: str
    prefect_home: Path

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = os.environ.copy()
        env.update(
            {
                "PREFECT_API_URL": self.api_url,
                "PREFECT_HOME": str(self.prefect_home),
                "PREFECT_LOGGING_LEVEL": "INFO",  # the canary test greps the logs: keep them verbose
                "PYTHONPATH": str(REPO),
                "TERM": "dumb",
                "COLUMNS": "200",
            }
        )
        env.update(extra or {})
        return env

    def command(
        self,
        store_url: str,
        run_id: str,
        overrides: Sequence[str] = (),
        kill_at: str | None = None,
        pause_at: str | None = None,
        config: str = TINY,
        full_at: str | None = None,
    ) -> list[str]:
        kill = ["--kill-at", kill_at] if kill_at else ["--pause-at", pause_at] if pause_at else []
        kill = ["--full-at", full_at] if full_at else kill
        args = ["run", config, f"store.url={store_url}", *overrides, "--run-id", run_id]
        return [sys.executable, "-m", "tests.reliability.runner", *kill, "--", *args]

    def start(
        self,
        store_url: str,
        run_id: str,
        *,
        overrides: Sequence[str] = (),
        kill_at: str | None = None,
        pause_at: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        config: str = TINY,
        full_at: str | None = None,
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(store_url, run_id, overrides, kill_at, pause_at, config, full_at),
            cwd=str(cwd or REPO),
            env=self.env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(
        self,
        store_url: str,
        run_id: str,
        *,
        overrides: Sequence[str] = (),
        kill_at: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = 240,
        config: str = TINY,
        full_at: str | None = None,
    ) -> Result:
        t0 = time.perf_counter()
        proc = self.start(
            store_url,
            run_id,
            overrides=overrides,
            kill_at=kill_at,
            env=env,
            cwd=cwd,
            config=config,
            full_at=full_at,
        )
        return finish(proc, t0, timeout)


def finish(proc: subprocess.Popen[str], t0: float, timeout: float = 240) -> Result:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(
            f"pipeline did not finish in {timeout} s:\n{out[-3000:]}\n{err[-3000:]}"
        ) from None
    return Result(proc.returncode, out, err, time.perf_counter() - t0)


@contextmanager
def prefect_server(home: Path) -> Iterator[Pipeline]:
    """A Prefect server on 127.0.0.1 with its own PREFECT_HOME (so its database can be inspected)."""
    port = free_port()
    env = os.environ.copy()
    env.update(
        {
            "PREFECT_HOME": str(home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_API_URL": "",
        }
    )
    prefect = str(Path(sys.executable).parent / "prefect")
    log = open(home / "server.log", "w")  # noqa: SIM115 - closed at teardown
    server = subprocess.Popen(
        [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--analytics-off"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        wait_healthy(api, proc=server, log=home / "server.log")
        yield Pipeline(api, home)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    """One Prefect server for every pipeline subprocess of the session."""
    with prefect_server(tmp_path_factory.mktemp("prefect-home")) as p:
        yield p


# ------------------------------------------------------------------------------------------------
# Reading a run back


def attempts(store_url: str, run_id: str) -> dict[str, str]:
    """``{stage: attempt}`` of every committed stage: a stage that ran again gets a new attempt."""
    return {m.stage: m.attempt for m in ArtifactStore(store_url).list_manifests(run_id)}


def uncommitted(store_url: str, run_id: str) -> list[str]:
    """Objects of the run that are neither its run records (run.json, links.json: where it is
    tracked, flows.run_links), a manifest nor a file a manifest lists: a partial attempt of a retried
    or interrupted write, a leftover lease."""
    store = ArtifactStore(store_url)
    run_dir = store.run_dir(run_id)
    allowed = {f"{run_dir}/run.json", f"{run_dir}/{LINKS}"}
    for m in store.list_manifests(run_id):
        stage_dir = f"{run_dir}/{m.stage}"
        allowed.add(f"{stage_dir}/manifest.json")
        allowed.update(f"{stage_dir}/{f.path}" for f in m.files)
    return sorted(set(store.fs.find(run_dir)) - allowed)


def policy_tensors(store_url: str, run_id: str, stage: str) -> dict[str, torch.Tensor]:
    """The policy weights of a committed checkpoint stage, loaded from its safetensors."""
    store = ArtifactStore(store_url)
    m = store.committed(run_id, stage)
    assert m is not None, f"{stage} of {run_id} is not committed"
    return safetensors.torch.load(store.read_bytes(m, "policy/model.safetensors"))


@dataclass(frozen=True)
class Reference:
    """Two uninterrupted runs of the tiny pipeline, ``left`` and ``right``, run in parallel on one
    store: the isolation test checks them against each other, the crash and fault tests compare their
    own runs with ``left``. Read-only: a test that needs the run to write into copies it."""

    store_url: str
    fingerprint: dict[str, str]


@pytest.fixture(scope="session")
def reference(pipeline: Pipeline, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """Made once per session, whatever the number of pytest-xdist workers: the first worker to ask
    makes it under an exclusive lock in the session's shared temporary directory, the others wait
    for it and read it back (it takes two pipeline runs, ~100 s on 2 cores)."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # gw0, gw1 share the parent
    store, done = shared / "reliability-reference", shared / "reliability-reference.json"
    with open(shared / "reliability-reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this worker dies
        if not done.exists():
            t0 = time.perf_counter()
            procs = {run_id: pipeline.start(str(store), run_id) for run_id in ("left", "right")}
            for run_id, proc in procs.items():
                r = finish(proc, t0)
                assert r.returncode == 0, f"reference run {run_id} failed:\n{r.output[-4000:]}"
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps(fingerprint(str(store), "left")))
            tmp.replace(done)
    return Reference(str(store), json.loads(done.read_text()))


# ------------------------------------------------------------------------------------------------
# One pipeline run on S3 through the fault proxy, with canary secrets in its environment

CANARIES = {
    "AWS_ACCESS_KEY_ID": "AKIACANARY7F3A9C0001",
    "AWS_SECRET_ACCESS_KEY": "canary-secret-7f3a9c-wJalrXUtnFEMIK7MDENG",
    "AWS_SESSION_TOKEN": "canary-session-token-7f3a9c-FwoGZXIvYXdzEJr",
    "HF_TOKEN": "hf_canary7f3a9cQwErTyUiOpAsDfGhJkL",
    "MLFLOW_TRACKING_PASSWORD": "canary-mlflow-password-7f3a9c",
    "GITHUB_TOKEN": "ghp_canary7f3a9c0123456789abcdefABCDEF",
    "WANDB_API_KEY": "canary-wandb-7f3a9c-0123456789abcdef",
}
FAULT_RATE = 0.1


@dataclass(frozen=True)
class S3Run:
    store_url: str
    run_id: str
    workdir: Path  # the run's working directory (MLflow's sqlite database and artifacts land here)
    result: Result
    requests: int
    faults: dict[str, int]


@pytest.fixture(scope="session")
def s3_faulty_run(
    pipeline: Pipeline, s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[S3Run]:
    """The tiny pipeline on ``s3://`` through :class:`FaultProxy` (``FAULT_RATE`` of requests hit by a
    500, 503, reset or delay), MLflow tracking on, every secret-looking variable a canary."""
    import boto3

    from tests.reliability.fault_proxy import FaultProxy

    bucket = "reliability-faults"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    workdir = tmp_path_factory.mktemp("s3-run")
    with FaultProxy(s3_endpoint, rate=FAULT_RATE, seed=9, delay_s=0.2) as proxy:
        env = {**CANARIES, "AWS_ENDPOINT_URL_S3": proxy.url, "AWS_DEFAULT_REGION": "us-east-1"}
        result = pipeline.run(
            f"s3://{bucket}/team", "faulty", overrides=["tracking.enabled=true"], env=env, cwd=workdir
        )
        yield S3Run(f"s3://{bucket}/team", "faulty", workdir, result, proxy.requests, dict(proxy.counts))
