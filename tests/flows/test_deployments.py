"""The CI path, for real: a Prefect server on 127.0.0.1, the cpu/gpu pools from infra/, `prefect deploy
--all` from prefect.yaml, process workers, and `prefect deployment run 'rlhf-pipeline/quickstart'`
for a tiny config in deployments mode against an S3-compatible endpoint (moto) on 127.0.0.1.

The gpu worker is preempted twice, as spot instances are: the first gpu worker and its flow-run
process are killed with SIGKILL in the middle of SFT (its first checkpoint committed), the second in
the middle of the RL loop (while writing the checkpoint after two updates); a fresh gpu worker is
started after each kill, and after the second the Prefect server is killed and started again. The
pipeline must notice each lost flow run by its silent heartbeat, mark it Crashed, dispatch the stage
again, and finish with artifacts identical to an uninterrupted run's, redoing no committed stage.
Also checks that SFT / RL / export ran on the gpu pool, the artifacts and the MLflow run, the nightly
deployment's schedule, that a stage dispatched while no gpu worker is online fails in one line
after ``execution.redispatch_timeout_s``, and that the event of a published verifier schedules a
rescore (the rescore deployment's trigger). Every process it starts is stopped
by its process group id (kills: the whole process tree).

Select it with `pytest -m deployments`; it takes ~4-5 minutes on 2 cores (each flow run is a fresh
Python process that imports torch, transformers and MLflow)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from flows.dispatch import StageRunError, run_stage_deployment
from tests.prefect_server import wait_healthy
from tests.reliability.conftest import attempts, fingerprint
from verl_core.config import ExecutionConfig, VerlFlowConfig
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin"
pytestmark = pytest.mark.deployments

DEPLOYED = [
    "execution.mode=deployments",
    "execution.shared_filesystem=true",  # for the sqlite MLflow file; the store itself is S3
    "execution.poll_interval_s=1",
    "execution.lost_after_s=30",  # renewed every 10 s; a preempted worker is replaced ~30 s after
]
TINY = [
    "data.arithmetic_train_size=64",
    "data.arithmetic_val_size=8",
    "sft.max_steps=6",
    "sft.batch_size=8",
    "sft.save_every=2",  # checkpoints at steps 2, 4, 6: the first preemption comes at the second
    "trainer.total_iterations=3",
    "trainer.save_freq=1",  # the second preemption: while writing ckpt/iter-0002
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
    """Processes started by this test, each in its own session so that its group id is its PID and
    stopping it also stops the flow-run processes a worker spawned."""

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
        procs.start_server(port, api)
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


TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _state(api: str, flow_run_id: str) -> str | None:
    """The flow run's state type, None while the API does not answer (the server restarting)."""
    try:
        with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}", timeout=10) as r:
            return str(json.loads(r.read())["state_type"])
    except OSError:
        return None


def _wait_for(path: Path, api: str, flow_run_id: str, timeout: float) -> None:
    """Until ``path`` exists (a paused flow-run process wrote it); fails if the pipeline ends first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert _state(api, flow_run_id) not in TERMINAL, f"the pipeline ended before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout:g} s"
        time.sleep(0.5)


def _final_state(api: str, flow_run_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while (state := _state(api, flow_run_id)) not in TERMINAL:
        assert time.monotonic() < deadline, f"the pipeline is still {state} after {timeout:g} s"
        time.sleep(2)
    assert state is not None
    return state


def _unclaimed_dispatch_fails_in_one_line(api: str, store_url: str) -> None:
    """No gpu worker online: a dispatched stage waits ``execution.redispatch_timeout_s`` and fails in
    one line naming the pool; its flow run is cancelled (no worker starting later picks it up)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    ctx = RunContext(run_id="no-worker", store_url=store_url)
    params = {
        "ctx": ctx.model_dump(mode="json"),
        "config": VerlFlowConfig().model_dump(mode="json"),
        "template_pack_uri": f"{store_url}/unused",
        "iteration": None,
    }
    execution = ExecutionConfig(poll_interval_s=0.5, redispatch_timeout_s=3)
    t0 = time.monotonic()
    with temporary_settings({PREFECT_API_URL: api}), pytest.raises(StageRunError) as e:
        run_stage_deployment(
            "export-model/export-stage",
            params,
            execution=execution,
            field="execution.export_deployment",
            store=ArtifactStore(store_url),
            run_id="no-worker",
        )
    elapsed = time.monotonic() - t0
    message = str(e.value)
    assert "\n" not in message and "no worker of work pool 'gpu'" in message, message
    assert "execution.redispatch_timeout_s" in message and "prefect worker start --pool gpu" in message
    assert 3 < elapsed < 60, elapsed
    [run] = _api(api, "/flow_runs/filter", {"flows": {"name": {"any_": ["export-model"]}}})
    assert run["state_type"] == "CANCELLED", run["state"]


def _published_verifier_schedules_a_rescore(env: dict[str, str], api: str) -> None:
    """The rescore deployment's trigger: the event a verifier's release emits schedules a rescore
    flow run with the payload's parameters (the list kept a list); cancelled before any cpu worker."""
    payload = {"run_id": "some-run", "overrides": ["reward.gsm8k_method=flexible"], "name": "flexible-v2"}
    _run(
        env, str(BIN / "prefect"), "event", "emit", "verl-flow.verifier.published",
        "--resource-id", "verl-flow.verifier.gsm8k", "--payload", json.dumps(payload),
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (runs := _api(api, "/flow_runs/filter", {"flow_runs": {"tags": {"all_": ["rescore"]}}})):
        assert time.monotonic() < deadline, "no rescore flow run 60 s after the verifier event"
        time.sleep(1)
    [run] = runs
    assert {k: run["parameters"][k] for k in payload} == payload, run["parameters"]
    assert run["parameters"]["store_url"] == env["VERL_FLOW_STORE_URL"]  # the deployment's own
    _api(api, f"/flow_runs/{run['id']}/set_state", {"state": {"type": "CANCELLED"}, "force": True})


def _flow_runs(api: str) -> dict[str, list[dict[str, Any]]]:
    """Every flow run on the server by flow name, oldest first, but for the nightly schedule's."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for fr in _api(api, "/flow_runs/filter", {"limit": 50, "sort": "EXPECTED_START_TIME_ASC"}):
        if fr["auto_scheduled"]:
            continue
        flow = _api(api, "/flows/filter", {"flows": {"id": {"any_": [fr["flow_id"]]}}})[0]["name"]
        runs.setdefault(flow, []).append(fr)
    return runs


def test_pipeline_on_the_gpu_pool_survives_two_preempted_gpu_workers(
    prefect_env: tuple[dict[str, str], Processes, str], tmp_path: Path, s3_bucket: str
) -> None:
    env, procs, api = prefect_env
    prefect = str(BIN / "prefect")
    _run(env, "bash", str(REPO / "infra/prefect/create_pools.sh"), "1")
    _run(env, prefect, "--no-prompt", "deploy", "--all", timeout=180)
    _unclaimed_dispatch_fails_in_one_line(api, f"{s3_bucket}/no-worker")
    _published_verifier_schedules_a_rescore(env, api)

    procs.start("worker-cpu", prefect, "worker", "start", "--pool", "cpu", "--name", "ci-cpu-worker")
    gpu = [prefect, "worker", "start", "--pool", "gpu"]
    paused = [tmp_path / "paused-sft", tmp_path / "paused-rl"]

    def preemptible(point: str, marker: Path) -> dict[str, str]:  # pauses its flow runs at `point`
        hooks = f"{REPO / 'tests' / 'flows' / 'preempt'}:{REPO}"
        return {"PYTHONPATH": hooks, "RELIABILITY_PAUSE_AT": point, "RELIABILITY_MARKER": str(marker)}

    procs.start("worker-gpu-1", *gpu, "--name", "gpu-1", env=preemptible("sft-second-checkpoint", paused[0]))

    store_url, run_id = f"{s3_bucket}/ci", "ci-deploy"
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = {
        "overrides": [*DEPLOYED, *TINY, f"store.url={store_url}", f"tracking.uri={tracking}"],
        "run_id": run_id,
    }
    # started as CI would, without --watch: its event stream ends when the server restarts (below)
    started = _run(
        env, prefect, "deployment", "run", "rlhf-pipeline/quickstart", "--params", json.dumps(params)
    )
    flow_run_id = re.findall(r"UUID: ([0-9a-f-]{36})", started.stdout)[0]
    # preemption 1: SFT paused while publishing its second checkpoint; worker and flow run killed
    _wait_for(paused[0], api, flow_run_id, 600)
    before_sft = attempts(store_url, run_id)
    assert "sft-ckpt" in before_sft and "sft" not in before_sft
    procs.kill_tree("worker-gpu-1")
    procs.start("worker-gpu-2", *gpu, "--name", "gpu-2", env=preemptible("checkpoint-save", paused[1]))
    # preemption 2: the RL loop paused while writing the checkpoint after two updates
    _wait_for(paused[1], api, flow_run_id, 600)
    before_rl = attempts(store_url, run_id)
    assert {"sft", "ckpt/iter-0001"} <= set(before_rl) and "ckpt/iter-0002" not in before_rl
    procs.kill_tree("worker-gpu-2")
    # and the Prefect server restarted meanwhile (same port and database): the pipeline's flow run,
    # its dispatcher and the cpu worker go on through it
    procs.restart("server")
    wait_healthy(api, 90)
    procs.start("worker-gpu-3", *gpu, "--name", "gpu-3")
    state = _final_state(api, flow_run_id, 900)
    logs = {p.stem: p.read_text(errors="replace") for p in sorted(tmp_path.glob("*.log"))}
    tails = "\n".join(f"--- {k}\n{v[-3000:]}" for k, v in logs.items() if k != "server")
    assert state == "COMPLETED", tails

    # each preempted stage: one flow run Crashed by the pipeline (silent heartbeat), one completed on
    # the next worker; nothing else dispatched again
    runs = _flow_runs(api)
    for flow, worker in (("sft-warmup", "worker-gpu-2"), ("rl-loop", "worker-gpu-3")):
        lost, done = runs[flow]
        assert lost["state_type"] == "CRASHED" and "lost: no heartbeat" in lost["state"]["message"], lost
        assert done["state_type"] == "COMPLETED", done["state"]
        assert done["work_pool_name"] == "gpu" and done["id"] in logs[worker]
    unclaimed, export = runs["export-model"]  # the first: dispatched while no gpu worker was online
    assert unclaimed["state_type"] == "CANCELLED"
    assert export["state_type"] == "COMPLETED" and export["id"] in logs["worker-gpu-3"]
    [parent] = runs["rlhf-pipeline"]
    assert parent["work_pool_name"] == "cpu" and parent["parent_task_run_id"] is None
    artifacts = _api(api, "/artifacts/filter", {"artifacts": {"key": {"any_": ["rlhf-run-summary"]}}})
    assert artifacts and run_id in artifacts[0]["data"]

    # no committed stage was redone: every stage committed at a kill keeps its attempt (old RL
    # checkpoints are pruned by trainer.max_ckpt_to_keep; sft-ckpt is SFT's latest checkpoint, each
    # save replaces it, so the resumed SFT replaced it with its later ones)
    after = attempts(store_url, run_id)
    for before in (before_sft, before_rl):
        kept = {s: a for s, a in before.items() if s in after and s != "sft-ckpt"}
        assert kept == {s: after[s] for s in kept}
        assert set(before) - set(after) <= {"ckpt/iter-0001"}
    assert {"preprocess", "template_pack", "sft", "iter-0002/update", "ckpt/iter-0003"} <= set(after)
    assert {"export/iter-0003", "eval/export-iter-0003", "report"} <= set(after)

    # identical to an uninterrupted run of the same config (local mode, same machine)
    ref_url = f"{s3_bucket}/reference"
    ref_tracking = f"sqlite:///{tmp_path / 'mlflow-ref.db'}"
    _run(env, str(BIN / "verl-flow"), "run", "configs/quickstart.yaml", *TINY, f"store.url={ref_url}",
         f"tracking.uri={ref_tracking}", "--run-id", run_id, timeout=300)  # fmt: skip
    assert fingerprint(store_url, run_id) == fingerprint(ref_url, run_id)

    # the MLflow run finished with a registered model
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking)
    found = client.search_runs(
        [client.get_experiment_by_name("verl-flow").experiment_id], f"tags.`verl_flow.run_id` = '{run_id}'"
    )
    assert len(found) == 1 and found[0].info.status == "FINISHED"
    assert found[0].data.tags["verl_flow.registered_model"].startswith("verl-flow-quickstart/")

    # the nightly deployment, deployed with the team variables set: a daily cron schedule, active, and
    # parameters pointing at the data snapshots (without them: tests/flows/test_deployments_day_two.py)
    nightly = _api(api, "/deployments/filter", {"deployments": {"name": {"any_": ["nightly-retrain"]}}})[0]
    assert [(s["schedule"]["cron"], s["active"]) for s in nightly["schedules"]] == [("0 3 * * *", True)]
    assert f"data.snapshot_prefix={tmp_path / 'snapshots'}" in nightly["parameters"]["overrides"]
    assert nightly["description"].startswith("Every night at 03:00 UTC")
