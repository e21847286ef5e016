"""The CI path, for real: a Prefect server on 127.0.0.1, the cpu/gpu pools from infra/, `prefect deploy
--all` from prefect.yaml, one process worker per pool, and `prefect deployment run
'rlhf-pipeline/quickstart' --watch` for a tiny config in deployments mode against an S3-compatible
endpoint (moto) on 127.0.0.1. Checks that the run completed, that SFT / RL / export ran as flow runs
on the gpu pool and were picked up by the gpu worker, that the artifacts and the MLflow run exist,
and the nightly deployment's schedule. Every process it starts is stopped by its process group id.

Select it with `pytest -m deployments`; it takes ~2-3 minutes on 2 cores (each flow run is a fresh
Python process that imports torch, transformers and MLflow)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests.prefect_server import wait_healthy
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin"
pytestmark = pytest.mark.deployments

TINY = [
    "execution.mode=deployments",
    "execution.shared_filesystem=true",  # for the sqlite MLflow file; the store itself is S3
    "execution.poll_interval_s=1",
    "data.arithmetic_train_size=64",
    "data.arithmetic_val_size=8",
    "sft.max_steps=2",
    "trainer.total_iterations=1",
    "trainer.test_freq=1",
    "trainer.val_before_train=false",
    "data.train_batch_size=8",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=8",
    "critic.ppo_mini_batch_size=8",
    "eval.k=2",
    "eval.max_samples=4",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """Processes started by this test, each in its own session so that its group id is its PID and
    stopping it also stops the flow-run processes a worker spawned."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.started: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []

    def start(self, name: str, *args: str) -> Path:
        log = self.logs / f"{name}.log"
        f = log.open("wb")
        p = subprocess.Popen(
            args, cwd=REPO, env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.started.append((p, f))
        return log

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


@pytest.fixture
def prefect_env(tmp_path: Path, s3_bucket: str) -> Iterator[tuple[dict[str, str], Processes, str]]:
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_HEARTBEAT_SECONDS": "5",
        "VERL_FLOW_HOME": str(REPO),
        # read by `prefect deploy` for the team deployments' parameters
        "VERL_FLOW_STORE_URL": f"{s3_bucket}/team",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "VERL_FLOW_DATA_PREFIX": str(tmp_path / "snapshots"),
    }
    procs = Processes(env, tmp_path)
    try:
        procs.start(
            "server",
            str(BIN / "prefect"),
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--analytics-off",
        )
        wait_healthy(api, 90)
        yield env, procs, api
    finally:
        procs.stop_all()


def _run(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _api(api: str, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        f"{api}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_pipeline_deployment_runs_gpu_stages_on_the_gpu_pool(
    prefect_env: tuple[dict[str, str], Processes, str], tmp_path: Path, s3_bucket: str
) -> None:
    env, procs, api = prefect_env
    prefect = str(BIN / "prefect")
    _run(env, "bash", str(REPO / "infra/prefect/create_pools.sh"), "1")
    _run(env, prefect, "--no-prompt", "deploy", "--all", timeout=180)
    procs.start("worker-cpu", prefect, "worker", "start", "--pool", "cpu", "--name", "ci-cpu-worker")
    gpu_log = procs.start(
        "worker-gpu", prefect, "worker", "start", "--pool", "gpu", "--name", "ci-gpu-worker"
    )

    store_url = f"{s3_bucket}/ci"
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = {
        "overrides": [*TINY, f"store.url={store_url}", f"tracking.uri={tracking}"],
        "run_id": "ci-deploy",
    }
    run = subprocess.run(
        [prefect, "deployment", "run", "rlhf-pipeline/quickstart", "--params", json.dumps(params),
         "--watch", "--watch-interval", "2", "--watch-timeout", "420"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=450,
    )  # fmt: skip
    logs = "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(tmp_path.glob("worker-*.log")))
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{logs}"

    # SFT, RL loop and export ran as completed flow runs on the gpu pool, taken by the gpu worker
    runs = _api(api, "/flow_runs/filter", {"limit": 50})
    by_flow = {}
    for fr in runs:
        flow = _api(api, "/flows/filter", {"flows": {"id": {"any_": [fr["flow_id"]]}}})[0]["name"]
        by_flow[flow] = fr
    for name in ("sft-warmup", "rl-loop", "export-model"):
        assert by_flow[name]["state_type"] == "COMPLETED", by_flow[name]["state"]
        assert by_flow[name]["work_pool_name"] == "gpu"
        assert by_flow[name]["id"] in gpu_log.read_text(errors="replace")
    assert by_flow["rlhf-pipeline"]["work_pool_name"] == "cpu"
    assert by_flow["rlhf-pipeline"]["parent_task_run_id"] is None
    artifacts = _api(api, "/artifacts/filter", {"artifacts": {"key": {"any_": ["rlhf-run-summary"]}}})
    assert artifacts and "ci-deploy" in artifacts[0]["data"]

    # artifacts in the S3 store, the MLflow run finished with a registered model
    store = ArtifactStore(store_url)
    stages = {m.stage for m in store.list_manifests("ci-deploy")}
    assert {"preprocess", "template_pack", "sft", "iter-0000/update", "ckpt/iter-0001"} <= stages
    assert {"export/iter-0001", "eval/export-iter-0001", "report"} <= stages
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking)
    found = client.search_runs(
        [client.get_experiment_by_name("verl-flow").experiment_id], "tags.`verl_flow.run_id` = 'ci-deploy'"
    )
    assert len(found) == 1 and found[0].info.status == "FINISHED"
    assert found[0].data.tags["verl_flow.registered_model"].startswith("verl-flow-quickstart/")

    # the nightly deployment: a daily cron schedule, and parameters pointing at the data snapshots
    nightly = _api(api, "/deployments/filter", {"deployments": {"name": {"any_": ["nightly-retrain"]}}})[0]
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 3 * * *"]
    assert f"data.snapshot_prefix={tmp_path / 'snapshots'}" in nightly["parameters"]["overrides"]
