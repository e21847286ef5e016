"""Three scheduled nights of ``nightly-retrain`` through a Prefect server, a worker and a deployment of
the pipeline with the nightly overrides (gate on, ``retrain.start_from=champion``), on the reliability
suite's tiny config (head size 32, as vLLM's CPU attention needs) and a new dated data snapshot each
night; serving follows through prefect.yaml's ``serve-model`` deployment, deployed with ``prefect
deploy``, its ``serve-on-model-promoted`` automation and a worker of its pool that runs vLLM's real
server (issue 40, "Done when" 1):

- night 1, no champion yet: SFT on the snapshot, whose every answer is ``#### 1``, then one RL
  iteration; it passes the floor (``gate.min_accuracy`` 0.5) and becomes ``champion``; the promoted
  event fires the automation, whose flow run serves ``models:/NAME@champion``;
- night 2 starts from the champion's export (run.json's origin says so) with a destructive actor
  learning rate (``actor.lr`` 1.0: Adam moves every weight by about the learning rate each step,
  ``actor.entropy_coeff`` keeps every gradient non-zero), on a snapshot with the same held-out prompts:
  worse, rejected, the alias stays, no event, the server unchanged; its flow run
  (``gate.require_promotion``) ends Failed with the decision, and ``verl-flow run
  --require-promotion`` on the same config exits 3 with the decision line;
- night 3's snapshot moves: new prompts whose answers are all ``#### 2``; the champion is evaluated
  again on them (its stored eval answered other prompts) and night 3, SFT-trained on them from the
  config's model, is better: promoted; the automation's new flow run replaces the server (the
  previous flow run ends Completed);
- ``verl-flow rollback`` gives ``champion`` back to night 1's version and the server follows.

Verdicts are asserted as following from the paired per-prompt answers the gate wrote
(``paired.parquet``: discordant counts, McNemar's p), not as particular accuracies. After each night
the server's ``/v1/models`` is read: the served names (``NAME/VERSION``, ``NAME@champion``) and the
``root``, ``.../sha256-<digest of the weights>``, compared with the export's digest. At the end the
last serve flow run is cancelled as a user would: no vLLM process, no record, no link is left.

vLLM's server of this model starts in ~40 s on 2 cores (~50 s from the event: the automation's
flow run starts first); night 1's start overlaps night 2. The test takes ~5.5 min (select with ``-m
deployments``)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.prefect_server import (
    BIN,
    TERMINAL,
    WORKER_ENV,
    Processes,
    _api,
    _free_port,
    _state,
    prefect_server,
)
from tests.vllm_env import vllm_python
from verl_core.algorithms.paired import discordant_pairs, mcnemar_exact
from verl_core.runtime import serve_records as records
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
TINY = "tests/reliability/tiny.yaml"
NAME = "nightly-gate"  # export.registered_model_name
ALPHA = 0.05  # 1 - gate.confidence (default 0.95)
SERVE = "serve-model/serve-model"  # prefect.yaml's deployment (flow serve-model, pool gpu)
pytestmark = pytest.mark.deployments


def nightly(root: Path) -> list[str]:
    """The nightly-retrain overrides (prefect.yaml's &nightly: snapshot, gate, start_from) on the tiny
    config, local mode: a jsonl snapshot (scored as arithmetic), SFT to learn its answers, one RL
    iteration that barely moves the policy, every held-out prompt evaluated greedily; the model has
    head size 32 (hidden 64, 2 heads), the smallest vLLM's CPU attention serves."""
    return [
        f"store.url={root / 'store'}", "tracking.enabled=true", "trainer.experiment_name=nightly-retrain",
        f"export.registered_model_name={NAME}", "gate.enable=true", "gate.min_accuracy=0.5",
        "retrain.start_from=champion", "data.source=jsonl", f"data.snapshot_prefix={root / 'snapshots'}",
        "data.train_files=[train.jsonl]", "data.val_files=[test.jsonl]",
        "data.data_source=synthetic/arithmetic", "data.ground_truth_regex=#### (\\d+)",
        "model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=2",
        "model.num_key_value_heads=2", "trainer.total_iterations=1", "actor.lr=1e-9", "critic.lr=1e-9",
        "eval.max_samples=0", "sft.max_steps=60", "sft.epochs=100", "sft.lr=5e-3",
        "sft.lr_scheduler=constant", "sft.save_every=0",
    ]  # fmt: skip


NIGHTS: dict[int, list[str]] = {
    1: [],  # no champion: from the config's model, SFT on answers '#### 1'
    # the champion's export (SFT skipped), RL at a learning rate that wrecks it; CI wants a promotion
    2: ["actor.lr=1.0", "actor.entropy_coeff=0.01", "gate.require_promotion=true"],
    3: ["retrain.start_from=config"],  # SFT from the config's model on the new answers '#### 2'
}
ANSWERS = {1: 1, 2: 1, 3: 2}  # every answer of the night's snapshot
HELDOUT_START = {1: 100, 2: 100, 3: 200}  # night 3's held-out prompts are new


def snapshot(root: Path, night: int) -> Path:
    """The night's dated snapshot (a new date, so a new run): 24 training and 12 held-out prompts."""
    day = root / "snapshots" / f"2026-11-2{night}"
    day.mkdir(parents=True)
    words = ["apple", "river", "stone", "cloud", "green", "seven", "table", "light"]
    for name, n, start in (
        ("train.jsonl", 24, HELDOUT_START[night] - 100),
        ("test.jsonl", 12, HELDOUT_START[night]),
    ):
        rows = [
            {"question": f"Item {words[i % 8]} {start + i}: answer?", "answer": f"#### {ANSWERS[night]}"}
            for i in range(n)
        ]
        (day / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return day


@dataclass
class Server:
    """The test's Prefect server: its API, the environment of its processes, the test's root."""

    env: dict[str, str]
    procs: Processes
    api: str
    root: Path
    port: int  # where the serve-model deployment's vLLM server listens

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def state(self) -> Path:
        return self.root / "serve-state"  # $VERL_FLOW_SERVE_DIR of the serving worker


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A Prefect server; the process pool 'nightly' and the nightly-retrain deployment of the pipeline;
    the pool 'gpu', prefect.yaml's serve-model deployment (``prefect deploy``, with its automation) on
    the test's store and port, and a worker of 'gpu' that runs vLLM's real server."""
    python = vllm_python()  # fail / skip before any work when the vLLM environment is missing
    tmp = tmp_path_factory.mktemp("nightly")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_TRACKING_URI"))}
    extra = {
        **WORKER_ENV,
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "VERL_FLOW_HOME": str(REPO),  # prefect.yaml's pull step
        "VERL_FLOW_STORE_URL": str(tmp / "store"),  # read by `prefect deploy`: the automation is on
        records.STATE_ENV: str(tmp / "serve-state"),
        "VERL_FLOW_VLLM_PYTHON": python,
    }
    old_state = os.environ.get(records.STATE_ENV)
    os.environ[records.STATE_ENV] = extra[records.STATE_ENV]  # this process reads the same records
    try:
        with prefect_server(tmp, base, extra) as (env, procs, api):
            served = Server(env, procs, api, tmp, _free_port())
            try:
                _deploy(served)
                procs.start("worker-gpu", str(BIN / "prefect"), "worker", "start", "--pool", "gpu")
                yield served
            finally:
                for record, _ in records.read_records():  # whatever a failed test left serving
                    records.stop_record(record, timeout_s=10)
    finally:
        if old_state is None:
            os.environ.pop(records.STATE_ENV, None)
        else:
            os.environ[records.STATE_ENV] = old_state


def _deploy(server: Server) -> None:
    """The pools, the nightly-retrain deployment (the pipeline with the nightly overrides) and
    prefect.yaml's serve-model deployment with its automation, set to serve on the test's port."""
    from prefect import get_client
    from prefect.client.schemas.actions import DeploymentUpdate, WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api}), get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="nightly", type="process"))
        client.create_work_pool(WorkPoolCreate(name="gpu", type="process"))
        flow_id = client.create_flow_from_name("rlhf-pipeline")
        client.create_deployment(
            flow_id,
            "nightly-retrain",
            entrypoint="flows/pipeline.py:rlhf_pipeline",
            work_pool_name="nightly",
            parameters={"config_file": TINY, "overrides": nightly(server.root)},
            pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}],
        )
    deploy = [str(BIN / "prefect"), "--no-prompt", "deploy", "--name", "serve-model"]
    done = subprocess.run(deploy, cwd=REPO, env=server.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with temporary_settings({PREFECT_API_URL: server.api}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(SERVE)
        parameters = dict(deployment.parameters)
        assert parameters["store_url"] == str(server.store)  # prefect.yaml's, from the environment
        # the team's server settings (edited on the deployment): a free port, the export's fp32,
        # vLLM's CPU settings
        parameters["settings"] = {
            **parameters["settings"], "host": "127.0.0.1", "port": server.port, "dtype": "float32",
            "rollout": {"vllm_enforce_eager": True, "cpu_kv_cache_gib": 1},
        }  # fmt: skip
        client.update_deployment(deployment.id, DeploymentUpdate(parameters=parameters))


def run_night(server: Server, night: int) -> tuple[str, str]:
    """The night's flow run of the deployment, run by a worker to its end: (state type, message)."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    snapshot(server.root, night)
    with temporary_settings({PREFECT_API_URL: server.api}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("rlhf-pipeline/nightly-retrain")
        parameters = {"overrides": [*nightly(server.root), *NIGHTS[night]]}
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
    worker = [str(BIN / "prefect"), "worker", "start", "--pool", "nightly", "--run-once", "--limit", "1"]
    started = time.monotonic()
    out = subprocess.run(worker, cwd=REPO, env=server.env, capture_output=True, text=True, timeout=420)
    print(f"night {night}: {time.monotonic() - started:.0f} s")  # shown with pytest -s
    deadline = time.monotonic() + 30
    while (state := _state(server.api, str(flow_run.id))) not in TERMINAL:
        assert time.monotonic() < deadline, (
            f"night {night}: {state}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
        time.sleep(1)
    recorded = _api(server.api, "/flow_runs/filter", {"flow_runs": {"id": {"any_": [str(flow_run.id)]}}})[0]
    return str(state), str(recorded["state"]["message"] or "") + out.stderr[-3000:]


def gate_of(root: Path, night: int) -> tuple[dict[str, Any], tuple[int, int] | None]:
    """The night's run: its gate decision record and the discordant pairs (b, c) of its paired table
    (None: no champion to pair with)."""
    store = ArtifactStore(str(root / "store"))
    snap = str(root / "snapshots" / f"2026-11-2{night}")
    [run] = [
        r for r in store.list_runs() if (store.read_run_record(r).origin or {}).get("data_snapshot") == snap
    ]
    m = store.read_manifest(store.manifest_uri(run, "gate"))
    record = json.loads(store.read_bytes(m, "decision.json"))
    pairs = store.read_table(m, "paired.parquet").to_pydict()
    if record["champion"] is None:
        return record, None
    return record, discordant_pairs(pairs["champion_correct"], pairs["challenger_correct"])


def aliases(server: Server) -> dict[str, str]:
    """The registered model's aliases → versions (what ``verl-flow models NAME`` lists)."""
    from stages.floor.registry import versions

    return {
        a: ref.version
        for ref in versions(f"sqlite:///{server.store / 'mlflow.db'}", NAME)
        for a in ref.aliases
    }


def _verl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "verl-flow"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=420
    )


def digest_of(server: Server, version: str) -> str:
    """The weights digest of a registered version's export (what a server of it must report)."""
    from flows.serving import resolve_model

    return resolve_model(f"models:/{NAME}/{version}", str(server.store)).digest


def serve_runs(server: Server) -> list[dict[str, Any]]:
    """The serve-model deployment's flow runs, oldest first."""
    body = {"flows": {"name": {"any_": ["serve-model"]}}, "sort": "EXPECTED_START_TIME_ASC", "limit": 20}
    return list(_api(server.api, "/flow_runs/filter", body))


def served(server: Server, version: str, timeout: float = 420) -> list[dict[str, Any]]:
    """``/v1/models`` of the deployment's server once it serves ``version`` (the automation's flow run
    has to start, and vLLM to load): NAME/VERSION first, then NAME@champion, both with ``root`` =
    ``<state dir>/NAME/sha256-<digest>`` of that version's weights."""
    expected = [
        (f"{NAME}/{version}", digest_of(server, version)),
        (f"{NAME}@champion", digest_of(server, version)),
    ]
    started, listed = time.monotonic(), None
    while time.monotonic() < started + timeout:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models", timeout=5) as r:
                listed = json.loads(r.read())["data"]
        except OSError:
            listed = None  # not started yet, or being replaced
        if listed and [(m["id"], Path(m["root"]).name.removeprefix("sha256-")) for m in listed] == expected:
            print(f"served {NAME}/{version} after {time.monotonic() - started:.0f} s")  # pytest -s
            assert all(Path(m["root"]).parent == server.state / NAME for m in listed)
            return list(listed)
        time.sleep(2)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in server.state.glob("*/server.log"))
    worker = (server.root / "worker-gpu.log").read_text(errors="replace")[-4000:]
    pytest.fail(f"{NAME}/{version} not served after {timeout:g} s: {listed}\n{worker}\n{logs}")


def promoted_events(api: str, n: int) -> list[dict[str, Any]]:
    """The server's verl-flow.model.promoted events, oldest first, once there are ``n`` (events are
    stored a moment after they arrive)."""
    body = {"filter": {"event": {"name": ["verl-flow.model.promoted"]}, "order": "ASC"}, "limit": 50}
    deadline = time.monotonic() + 30
    while len(events := _api(api, "/events/filter", body)["events"]) < n and time.monotonic() < deadline:
        time.sleep(1)
    return list(events)


def ours(server: Server) -> list[str]:
    """Command lines of live processes that serve from the test's serve state directory (vLLM's)."""
    found = subprocess.run(["pgrep", "-af", str(server.state)], capture_output=True, text=True)
    return found.stdout.splitlines()


def test_three_nights_gate_promote_reject_rollback(server: Server) -> None:
    env, api, root = server.env, server.api, server.root

    # night 1: no champion; the floor decides; the automation serves it
    state, message = run_night(server, 1)
    assert state == "COMPLETED", message
    record, pairs = gate_of(root, 1)
    assert pairs is None and record["verdict"] == "pass" and "first model" in record["line"]
    assert record["decision"]["challenger"]["accuracy"] >= 0.5  # the floor, gate.min_accuracy
    assert aliases(server) == {"champion": "1"}
    [event] = promoted_events(api, 1)
    assert event["resource"]["prefect.resource.id"] == f"verl-flow.model.{NAME}"
    payload = event["payload"]
    assert (payload["version"], payload["by"], payload["previous"]) == ("1", "gate", "")
    # (the automation's server starts while night 2 trains: checked after night 2)

    # night 2: the champion's export wrecked → worse, rejected; alias, event count, server unchanged
    state, message = run_night(server, 2)
    record, pairs = gate_of(root, 2)
    assert record["verdict"] == "reject" and pairs is not None
    b, c = pairs
    assert b > c and mcnemar_exact(b, c) < ALPHA  # the paired answers say: significantly worse
    assert record["decision"]["difference_ci"]["high"] < 0  # the difference's interval: below 0
    assert state == "FAILED" and record["line"] in message
    assert aliases(server) == {"champion": "1"}
    store = ArtifactStore(str(server.store))
    runs = {(store.read_run_record(r).origin or {}).get("data_snapshot"): r for r in store.list_runs()}
    origin = store.read_run_record(runs[str(root / "snapshots/2026-11-22")]).origin
    assert (
        origin is not None
        and origin["start_from"] == "champion"
        and origin["model_uri"] == f"models:/{NAME}/1"
    )
    # CI: the same night from the command line resumes the run and exits 3 with the decision's line
    cli = _verl(env, "run", TINY, *nightly(root), *NIGHTS[2], "--require-promotion")
    assert cli.returncode == 3, cli.stdout[-2000:] + cli.stderr[-2000:]
    assert cli.stderr.strip().splitlines()[-1] == f"error: {record['line']}"
    # night 1 served by the automation's flow run, and night 2 changed nothing: no event, no new run
    served(server, "1")
    assert len(promoted_events(api, 1)) == 1
    [first] = serve_runs(server)
    assert first["parameters"]["target"] == f"models:/{NAME}@champion"  # the trigger's template

    # night 3: new prompts, new answers → the champion evaluated again on them; better, promoted;
    # the automation's new flow run replaces the server
    state, message = run_night(server, 3)
    assert state == "COMPLETED", message
    record, pairs = gate_of(root, 3)
    assert record["verdict"] == "pass" and pairs is not None
    assert not record["champion"]["reused_eval"]  # its stored eval answered night 1's prompts
    b, c = pairs
    assert c > b and mcnemar_exact(b, c) < ALPHA  # the paired answers say: significantly better
    assert aliases(server) == {"champion": "3", "previous-champion": "1"}
    assert digest_of(server, "3") != digest_of(server, "1")
    served(server, "3")

    # rollback: night 1's version serves again, recorded, announced, followed
    out = _verl(env, "rollback", NAME, "--store", str(server.store))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{NAME} rolled back: version 1 is the champion (was version 3)"
    assert aliases(server) == {"champion": "1"}
    served(server, "1")
    events = promoted_events(api, 3)
    assert [(e["payload"]["version"], e["payload"]["by"]) for e in events] == [
        ("1", "gate"),
        ("3", "gate"),
        ("1", "rollback"),
    ]
    # each replaced flow run ended Completed; the serving one runs until cancelled, as a user does
    *replaced, last = serve_runs(server)
    assert [r["state_type"] for r in replaced] == ["COMPLETED", "COMPLETED"], replaced
    assert last["state_type"] == "RUNNING"
    _api(api, f"/flow_runs/{last['id']}/set_state", {"state": {"type": "CANCELLING"}, "force": True})
    deadline = time.monotonic() + 90
    while (state := _state(api, last["id"])) != "CANCELLED":
        assert time.monotonic() < deadline, state
        time.sleep(1)
    # nothing left: no vLLM process, no record, no weights link (the server's log stays)
    deadline = time.monotonic() + 30
    while ours(server) and time.monotonic() < deadline:
        time.sleep(1)
    assert ours(server) == [] and records.read_records() == []
    left = sorted(p.relative_to(server.state).as_posix() for p in server.state.rglob("*"))
    assert left == [NAME, f"{NAME}/{records.LOG}"], left
