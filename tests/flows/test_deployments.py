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

The module fixture :func:`deployed` drives all of it once (the server, the workers, the kills and
restarts, the pipeline's run) and records what it saw without asserting; each test then asserts one
behaviour on the record, so a failing behaviour hides none of the others. A step the fixture could not
finish (a pause that never came) is reported by every test that reads what that step records.

Select it with `pytest -m deployments`; it takes ~7 minutes on 2 cores, 5 of them the fixture's (each
flow run is a fresh Python process that imports torch, transformers and MLflow), 1.5 the reference run."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flows.dispatch import StageRunError, run_stage_deployment
from tests.prefect_server import (
    BIN,
    REPO,
    TERMINAL,
    WORKER_ENV,
    Processes,
    _api,
    _state,
    prefect_server,
    wait_healthy,
)
from tests.reliability.conftest import attempts, fingerprint
from verl_core.config import ExecutionConfig, VerlFlowConfig
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore

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
RUN_ID = "ci-deploy"
VERIFIER_PAYLOAD = {
    "run_id": "some-run",
    "overrides": ["reward.gsm8k_method=flexible"],
    "name": "flexible-v2",
}


def _run(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


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


def _flow_runs(api: str) -> dict[str, list[dict[str, Any]]]:
    """Every flow run on the server by flow name, oldest first, but for the nightly schedule's."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for fr in _api(api, "/flow_runs/filter", {"limit": 50, "sort": "EXPECTED_START_TIME_ASC"}):
        if fr["auto_scheduled"]:
            continue
        flow = _api(api, "/flows/filter", {"flows": {"id": {"any_": [fr["flow_id"]]}}})[0]["name"]
        runs.setdefault(flow, []).append(fr)
    return runs


@dataclass
class Deployed:
    """What :func:`deployed` did and saw. A field stays None when the step that records it did not
    finish; :meth:`get` then fails with that step's error."""

    env: dict[str, str]
    api: str
    root: Path  # the processes' logs, the MLflow databases, the snapshot prefix
    bucket: str  # s3://...: the pipeline's store under /ci
    errors: list[str] = field(default_factory=list)  # the steps that raised, with their tracebacks
    # a stage dispatched while no gpu worker is online: StageRunError's message, its seconds, the run
    unclaimed_message: str | None = None
    unclaimed_seconds: float | None = None
    unclaimed_runs: list[dict[str, Any]] | None = None
    rescore_runs: list[dict[str, Any]] | None = None  # what the verifier event scheduled
    flow_run_id: str | None = None  # the pipeline's
    before_sft: dict[str, str] | None = None  # committed attempts when the first gpu worker is killed
    before_rl: dict[str, str] | None = None  # ... when the second is
    state: str | None = None  # the pipeline's final state, after the server restart
    runs: dict[str, list[dict[str, Any]]] | None = None  # _flow_runs at the end
    after: dict[str, str] | None = None  # committed attempts at the end
    logs: dict[str, str] = field(default_factory=dict)  # every process's log by name

    @property
    def store_url(self) -> str:
        return f"{self.bucket}/ci"

    @property
    def tracking(self) -> str:
        return f"sqlite:///{self.root / 'mlflow.db'}"

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Run a step; an exception is recorded, not raised (the tests that need the step report it)."""
        try:
            yield
        except Exception:
            self.errors.append(f"--- step {name!r} failed:\n{traceback.format_exc()}")

    def get(self, name: str) -> Any:
        value = getattr(self, name)
        if value is None:
            steps = "\n".join(self.errors) or "(no step raised)"
            pytest.fail(f"the fixture recorded no {name}:\n{steps}\n{self.tails}", pytrace=False)
        return value

    @property
    def tails(self) -> str:
        """The end of every log but the server's, for a failure's message."""
        return "\n".join(f"--- {k}\n{v[-3000:]}" for k, v in self.logs.items() if k != "server")


def _dispatch_with_no_gpu_worker(d: Deployed) -> None:
    """No gpu worker online: dispatch the export stage with ``execution.redispatch_timeout_s`` 3."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    store_url = f"{d.bucket}/no-worker"
    ctx = RunContext(run_id="no-worker", store_url=store_url)
    params = {
        "ctx": ctx.model_dump(mode="json"),
        "config": VerlFlowConfig().model_dump(mode="json"),
        "template_pack_uri": f"{store_url}/unused",
        "iteration": None,
    }
    execution = ExecutionConfig(poll_interval_s=0.5, redispatch_timeout_s=3)
    t0 = time.monotonic()
    with temporary_settings({PREFECT_API_URL: d.api}):
        try:
            run_stage_deployment(
                "export-model/export-stage",
                params,
                execution=execution,
                field="execution.export_deployment",
                store=ArtifactStore(store_url),
                run_id="no-worker",
            )
            d.unclaimed_message = ""  # no StageRunError: the test says so
        except StageRunError as e:
            d.unclaimed_message = str(e)
    d.unclaimed_seconds = time.monotonic() - t0
    d.unclaimed_runs = _api(d.api, "/flow_runs/filter", {"flows": {"name": {"any_": ["export-model"]}}})


def _emit_verifier_published(d: Deployed, payload: dict[str, Any]) -> None:
    """Emit a verifier's release event; record the rescore flow runs it schedules (waits up to 60 s
    for one), then cancel them before any cpu worker is online."""
    _run(
        d.env, str(BIN / "prefect"), "event", "emit", "verl-flow.verifier.published",
        "--resource-id", "verl-flow.verifier.gsm8k", "--payload", json.dumps(payload),
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (runs := _api(d.api, "/flow_runs/filter", {"flow_runs": {"tags": {"all_": ["rescore"]}}})):
        assert time.monotonic() < deadline, "no rescore flow run 60 s after the verifier event"
        time.sleep(1)
    d.rescore_runs = runs
    for run in runs:
        _api(d.api, f"/flow_runs/{run['id']}/set_state", {"state": {"type": "CANCELLED"}, "force": True})


def _preempted_pipeline(d: Deployed, procs: Processes) -> None:
    """The pipeline through two preempted gpu workers and a server restart, to its final state."""
    prefect = str(BIN / "prefect")
    procs.start("worker-cpu", prefect, "worker", "start", "--pool", "cpu", "--name", "ci-cpu-worker")
    gpu = [prefect, "worker", "start", "--pool", "gpu"]
    paused = [d.root / "paused-sft", d.root / "paused-rl"]

    def preemptible(point: str, marker: Path) -> dict[str, str]:  # pauses its flow runs at `point`
        hooks = f"{REPO / 'tests' / 'flows' / 'preempt'}:{REPO}"
        return {"PYTHONPATH": hooks, "RELIABILITY_PAUSE_AT": point, "RELIABILITY_MARKER": str(marker)}

    procs.start("worker-gpu-1", *gpu, "--name", "gpu-1", env=preemptible("sft-second-checkpoint", paused[0]))
    params = {
        "overrides": [*DEPLOYED, *TINY, f"store.url={d.store_url}", f"tracking.uri={d.tracking}"],
        "run_id": RUN_ID,
    }
    # started as CI would, without --watch: its event stream ends when the server restarts (below)
    started = _run(
        d.env, prefect, "deployment", "run", "rlhf-pipeline/quickstart", "--params", json.dumps(params)
    )
    d.flow_run_id = flow_run_id = re.findall(r"UUID: ([0-9a-f-]{36})", started.stdout)[0]
    # preemption 1: SFT paused while publishing its second checkpoint; worker and flow run killed
    _wait_for(paused[0], d.api, flow_run_id, 600)
    d.before_sft = attempts(d.store_url, RUN_ID)
    procs.kill_tree("worker-gpu-1")
    procs.start("worker-gpu-2", *gpu, "--name", "gpu-2", env=preemptible("checkpoint-save", paused[1]))
    # preemption 2: the RL loop paused while writing the checkpoint after two updates
    _wait_for(paused[1], d.api, flow_run_id, 600)
    d.before_rl = attempts(d.store_url, RUN_ID)
    procs.kill_tree("worker-gpu-2")
    # and the Prefect server restarted meanwhile (same port and database): the pipeline's flow run,
    # its dispatcher and the cpu worker go on through it
    procs.restart("server")
    wait_healthy(d.api, 90)
    procs.start("worker-gpu-3", *gpu, "--name", "gpu-3")
    d.state = _final_state(d.api, flow_run_id, 900)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> Iterator[Deployed]:
    """The server with the pools and every deployment of prefect.yaml (deployed with the team
    variables), then in order: a stage dispatched with no gpu worker online, a verifier's release
    event, the preempted pipeline's run; then the flow runs, attempts and logs at the end."""
    import boto3

    root = tmp_path_factory.mktemp("deployments")
    bucket = f"verl-flow-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    team = {  # read by `prefect deploy` for the team deployments' parameters
        "VERL_FLOW_STORE_URL": f"s3://{bucket}/team",
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        "VERL_FLOW_DATA_PREFIX": str(root / "snapshots"),
    }
    extra = {**WORKER_ENV, "PREFECT_WORKER_HEARTBEAT_SECONDS": "5", "VERL_FLOW_HOME": str(REPO), **team}
    with prefect_server(root, extra=extra) as (env, procs, api):
        _run(env, "bash", str(REPO / "infra/prefect/create_pools.sh"), "1")
        _run(env, str(BIN / "prefect"), "--no-prompt", "deploy", "--all", timeout=180)
        d = Deployed(env, api, root, f"s3://{bucket}")
        with d.step("a stage dispatched with no gpu worker online"):
            _dispatch_with_no_gpu_worker(d)
        with d.step("the verifier event"):
            _emit_verifier_published(d, VERIFIER_PAYLOAD)
        with d.step("the preempted pipeline"):
            _preempted_pipeline(d, procs)
        if d.state is None and d.flow_run_id is not None:  # it stopped early: the state it ended in
            with d.step("the pipeline's state at the end"):
                d.state = state if (state := _state(api, d.flow_run_id)) in TERMINAL else None
        with d.step("the flow runs at the end"):
            d.runs = _flow_runs(api)
        with d.step("the attempts at the end"):
            d.after = attempts(d.store_url, RUN_ID)
        d.logs = {p.stem: p.read_text(errors="replace") for p in sorted(root.glob("*.log"))}
        yield d


def test_a_stage_dispatched_while_no_gpu_worker_is_online_fails_in_one_line(deployed: Deployed) -> None:
    """No gpu worker online: a dispatched stage waits ``execution.redispatch_timeout_s`` and fails in
    one line naming the pool; its flow run is cancelled (no worker starting later picks it up)."""
    message = deployed.get("unclaimed_message")
    assert message, "run_stage_deployment raised no StageRunError"
    assert "\n" not in message and "no worker of work pool 'gpu'" in message, message
    assert "execution.redispatch_timeout_s" in message and "prefect worker start --pool gpu" in message
    elapsed = deployed.get("unclaimed_seconds")
    assert 3 < elapsed < 60, elapsed
    [run] = deployed.get("unclaimed_runs")
    assert run["state_type"] == "CANCELLED", run["state"]
    # still cancelled at the end, while gpu workers were online: the first export-model run
    unclaimed = deployed.get("runs").get("export-model", [{"id": None}])[0]
    assert unclaimed["id"] == run["id"] and unclaimed["state_type"] == "CANCELLED", unclaimed["state"]


def test_a_published_verifier_schedules_a_rescore(deployed: Deployed) -> None:
    """The rescore deployment's trigger: the event a verifier's release emits schedules a rescore
    flow run with the payload's parameters (the list kept a list)."""
    [run] = deployed.get("rescore_runs")
    payload = VERIFIER_PAYLOAD
    assert {k: run["parameters"][k] for k in payload} == payload, run["parameters"]
    assert run["parameters"]["store_url"] == deployed.env["VERL_FLOW_STORE_URL"]  # the deployment's own


def _lost_then_redone(d: Deployed, flow: str, worker: str) -> None:
    """The preempted stage: one flow run Crashed by the pipeline (silent heartbeat), one completed on
    the next worker; nothing else dispatched again."""
    runs = d.get("runs")
    assert len(runs.get(flow, [])) == 2, (runs.get(flow), d.tails)
    lost, done = runs[flow]
    assert lost["state_type"] == "CRASHED" and "lost: no heartbeat" in lost["state"]["message"], lost
    assert done["state_type"] == "COMPLETED", done["state"]
    assert done["work_pool_name"] == "gpu" and done["id"] in d.logs[worker]


def _kept(d: Deployed, before: dict[str, str]) -> None:
    """No committed stage was redone: every stage committed at a kill keeps its attempt (old RL
    checkpoints are pruned by trainer.max_ckpt_to_keep; sft-ckpt is SFT's latest checkpoint, each
    save replaces it, so the resumed SFT replaced it with its later ones)."""
    after = d.get("after")
    kept = {s: a for s, a in before.items() if s in after and s != "sft-ckpt"}
    assert kept == {s: after[s] for s in kept}
    assert set(before) - set(after) <= {"ckpt/iter-0001"}


def test_sft_preempted_mid_checkpoint_is_crashed_and_redone_on_the_next_gpu_worker(
    deployed: Deployed,
) -> None:
    before_sft = deployed.get("before_sft")
    assert "sft-ckpt" in before_sft and "sft" not in before_sft
    _lost_then_redone(deployed, "sft-warmup", "worker-gpu-2")
    _kept(deployed, before_sft)


def test_the_rl_loop_preempted_mid_checkpoint_is_crashed_and_redone_on_the_next_gpu_worker(
    deployed: Deployed,
) -> None:
    before_rl = deployed.get("before_rl")
    assert {"sft", "ckpt/iter-0001"} <= set(before_rl) and "ckpt/iter-0002" not in before_rl
    _lost_then_redone(deployed, "rl-loop", "worker-gpu-3")
    _kept(deployed, before_rl)


def test_the_pipeline_completes_through_a_server_restart_with_every_stage_committed(
    deployed: Deployed,
) -> None:
    """The pipeline's own flow run (on the cpu pool) goes on through the server's restart to
    Completed, with its summary artifact and every stage committed in the store."""
    assert deployed.get("state") == "COMPLETED", deployed.tails
    [parent] = deployed.get("runs")["rlhf-pipeline"]
    assert parent["work_pool_name"] == "cpu" and parent["parent_task_run_id"] is None
    artifacts = _api(
        deployed.api, "/artifacts/filter", {"artifacts": {"key": {"any_": ["rlhf-run-summary"]}}}
    )
    assert artifacts and RUN_ID in artifacts[0]["data"]
    after = deployed.get("after")
    assert {"preprocess", "template_pack", "sft", "iter-0002/update", "ckpt/iter-0003"} <= set(after)
    assert {"export/iter-0003", "eval/export-iter-0003", "report"} <= set(after)


def test_export_runs_on_the_gpu_pool(deployed: Deployed) -> None:
    runs = deployed.get("runs")
    assert len(runs.get("export-model", [])) == 2, (runs.get("export-model"), deployed.tails)
    unclaimed, export = runs["export-model"]  # the first: dispatched while no gpu worker was online
    assert unclaimed["state_type"] == "CANCELLED"
    assert export["state_type"] == "COMPLETED" and export["id"] in deployed.logs["worker-gpu-3"]


def test_the_artifacts_are_identical_to_an_uninterrupted_runs(deployed: Deployed) -> None:
    """The same config in local mode on the same machine, never interrupted."""
    ref_url = f"{deployed.bucket}/reference"
    ref_tracking = f"sqlite:///{deployed.root / 'mlflow-ref.db'}"
    overrides = [*TINY, f"store.url={ref_url}", f"tracking.uri={ref_tracking}"]
    cli = [str(BIN / "verl-flow"), "run", "configs/quickstart.yaml", *overrides, "--run-id", RUN_ID]
    _run(deployed.env, *cli, timeout=300)
    assert fingerprint(deployed.store_url, RUN_ID) == fingerprint(ref_url, RUN_ID)


def test_the_mlflow_run_finished_with_a_registered_model(deployed: Deployed) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=deployed.tracking)
    found = client.search_runs(
        [client.get_experiment_by_name("verl-flow").experiment_id], f"tags.`verl_flow.run_id` = '{RUN_ID}'"
    )
    assert len(found) == 1 and found[0].info.status == "FINISHED"
    assert found[0].data.tags["verl_flow.registered_model"].startswith("verl-flow-quickstart/")


def test_the_nightly_deployment_runs_daily_on_the_data_snapshots(deployed: Deployed) -> None:
    """Deployed with the team variables set: a daily cron schedule, active, and parameters pointing at
    the data snapshots (without them: tests/flows/test_deployments_day_two.py)."""
    api = deployed.api
    nightly = _api(api, "/deployments/filter", {"deployments": {"name": {"any_": ["nightly-retrain"]}}})[0]
    assert [(s["schedule"]["cron"], s["active"]) for s in nightly["schedules"]] == [("0 3 * * *", True)]
    assert f"data.snapshot_prefix={deployed.root / 'snapshots'}" in nightly["parameters"]["overrides"]
    assert nightly["description"].startswith("Every night at 03:00 UTC")
