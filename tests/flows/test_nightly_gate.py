"""Three scheduled nights of ``nightly-retrain`` through a Prefect server, a worker and a deployment of
the pipeline with the nightly overrides (gate on, ``retrain.start_from=champion``), on the reliability
suite's tiny config and a new dated data snapshot each night (issue 40, "Done when" 1):

- night 1, no champion yet: the untrained model passes the floor (``gate.min_accuracy`` 0) and
  becomes ``champion``; the promoted event reaches the server;
- night 2 starts from the champion's export (run.json's origin says so) and changes nothing that
  matters (``actor.lr`` 1e-9: the same greedy answers), so it is no better: rejected, the alias stays;
  its flow run (``gate.require_promotion``) ends Failed with the decision, and
  ``verl-flow run --require-promotion`` on the same config exits 3 with the decision line;
- night 3 is trained (SFT) on the snapshot, whose every answer is ``#### 1``: better, promoted;
- ``verl-flow rollback`` gives ``champion`` back to night 1's version.

"Worse" and "better" are asserted as the decision following from the paired per-prompt answers the
gate wrote (discordant counts and McNemar's p), not as particular accuracies.

Serving follows the champion through ``models:/NAME@champion``: after each night the weights digest
that ``verl-flow serve models:/NAME@champion`` (and the serve-model deployment the promoted event
triggers) resolves to is checked (:func:`flows.serving.resolve_model`, the digest the server reports
in ``/v1/models``): unchanged by night 2, night 3's after night 3, night 1's after the rollback. No vLLM
server is started here (one per night is beyond this test's time on a 2-core box); the real server's
report of that digest is tests/vllm's.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.flows.test_deployments import TERMINAL, Processes, _api, _free_port, _state
from verl_core.algorithms.paired import discordant_pairs, mcnemar_exact
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin"
TINY = "tests/reliability/tiny.yaml"
NAME = "nightly-gate"  # export.registered_model_name
ALPHA = 0.05  # 1 - gate.confidence (default 0.95)
pytestmark = pytest.mark.deployments


def nightly(root: Path) -> list[str]:
    """The nightly-retrain overrides (prefect.yaml's &nightly: snapshot, gate, start_from) on the tiny
    config, local mode: a jsonl snapshot whose answers are all ``#### 1`` (scored as arithmetic), one
    RL iteration that barely moves the policy, every held-out prompt evaluated greedily."""
    return [
        f"store.url={root / 'store'}", "tracking.enabled=true", "trainer.experiment_name=nightly-retrain",
        f"export.registered_model_name={NAME}", "gate.enable=true", "retrain.start_from=champion",
        "data.source=jsonl", f"data.snapshot_prefix={root / 'snapshots'}",
        "data.train_files=[train.jsonl]", "data.val_files=[test.jsonl]",
        "data.data_source=synthetic/arithmetic", "data.ground_truth_regex=#### (\\d+)",
        "trainer.total_iterations=1", "actor.lr=1e-9", "critic.lr=1e-9", "eval.max_samples=0",
        "sft.max_steps=30", "sft.epochs=100", "sft.lr=2e-2", "sft.lr_scheduler=constant", "sft.save_every=0",
    ]  # fmt: skip


NIGHTS: dict[int, list[str]] = {
    1: ["sft.enable=false"],  # an untrained model: no answer right
    2: ["gate.require_promotion=true"],  # the champion's export, RL at lr 1e-9: the same answers
    3: ["retrain.start_from=config"],  # SFT on the snapshot from scratch: answers '#### 1'
}


def snapshot(root: Path, night: int) -> Path:
    """The night's dated snapshot (the same rows every night; a new date, so a new run)."""
    day = root / "snapshots" / f"2026-11-2{night}"
    day.mkdir(parents=True)
    words = ["apple", "river", "stone", "cloud", "green", "seven", "table", "light"]
    for name, n, start in (("train.jsonl", 24, 0), ("test.jsonl", 12, 100)):
        rows = [
            {"question": f"Item {words[i % 8]} {start + i}: answer?", "answer": "#### 1"} for i in range(n)
        ]
        (day / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return day


Server = tuple[dict[str, str], Processes, str, Path]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A Prefect server, the process pool 'nightly' and the nightly-retrain deployment of the pipeline."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    tmp = tmp_path_factory.mktemp("nightly")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_TRACKING_URI"))}
    env |= {
        "PREFECT_HOME": str(tmp / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    procs = Processes(env, tmp)
    try:
        procs.start_server(port, api)
        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            client.create_work_pool(WorkPoolCreate(name="nightly", type="process"))
            flow_id = client.create_flow_from_name("rlhf-pipeline")
            client.create_deployment(
                flow_id,
                "nightly-retrain",
                entrypoint="flows/pipeline.py:rlhf_pipeline",
                work_pool_name="nightly",
                parameters={"config_file": TINY, "overrides": nightly(tmp)},
                pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}],
            )
        yield env, procs, api, tmp
    finally:
        procs.stop_all()


def run_night(server: Server, night: int) -> tuple[str, str]:
    """The night's flow run of the deployment, run by a worker to its end: (state type, message)."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env, _, api, root = server
    snapshot(root, night)
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("rlhf-pipeline/nightly-retrain")
        parameters = {"overrides": [*nightly(root), *NIGHTS[night]]}
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
    worker = [str(BIN / "prefect"), "worker", "start", "--pool", "nightly", "--run-once", "--limit", "1"]
    started = time.monotonic()
    out = subprocess.run(worker, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    print(f"night {night}: {time.monotonic() - started:.0f} s")  # shown with pytest -s
    deadline = time.monotonic() + 30
    while (state := _state(api, str(flow_run.id))) not in TERMINAL:
        assert time.monotonic() < deadline, (
            f"night {night}: {state}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
        time.sleep(1)
    recorded = _api(api, "/flow_runs/filter", {"flow_runs": {"id": {"any_": [str(flow_run.id)]}}})[0]
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

    uri = f"sqlite:///{server[3] / 'store' / 'mlflow.db'}"
    return {a: ref.version for ref in versions(uri, NAME) for a in ref.aliases}


def _verl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "verl-flow"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=420
    )


def champion_digest(root: Path, version: str = "") -> str:
    """The weights digest ``verl-flow serve models:/NAME@champion`` serves now (or of ``version``)."""
    from flows.serving import resolve_model

    target = f"models:/{NAME}/{version}" if version else f"models:/{NAME}@champion"
    return resolve_model(target, str(root / "store")).digest


def promoted_events(api: str, n: int) -> list[dict[str, Any]]:
    """The server's verl-flow.model.promoted events, oldest first, once there are ``n`` (events are
    stored a moment after they arrive)."""
    body = {"filter": {"event": {"name": ["verl-flow.model.promoted"]}, "order": "ASC"}, "limit": 50}
    deadline = time.monotonic() + 30
    while len(events := _api(api, "/events/filter", body)["events"]) < n and time.monotonic() < deadline:
        time.sleep(1)
    return list(events)


def test_three_nights_gate_promote_reject_rollback(server: Server) -> None:
    env, _, api, root = server

    # night 1: no champion; the floor decides
    state, message = run_night(server, 1)
    assert state == "COMPLETED", message
    record, pairs = gate_of(root, 1)
    assert pairs is None and record["verdict"] == "pass" and "first model" in record["line"]
    assert aliases(server) == {"champion": "1"}
    [event] = promoted_events(api, 1)
    assert event["resource"]["prefect.resource.id"] == f"verl-flow.model.{NAME}"
    payload = event["payload"]
    assert (payload["version"], payload["by"], payload["previous"]) == ("1", "gate", "")
    night1 = champion_digest(root)
    assert night1 == champion_digest(root, "1")

    # night 2: from the champion's export, no better → rejected, alias unmoved, the flow run Failed
    state, message = run_night(server, 2)
    record, pairs = gate_of(root, 2)
    assert record["verdict"] == "reject" and pairs is not None
    b, c = pairs
    assert not (c > b and mcnemar_exact(b, c) < ALPHA)  # the paired answers say: not better
    assert state == "FAILED" and record["line"] in message
    assert aliases(server) == {"champion": "1"}
    assert champion_digest(root) == night1  # serving unchanged
    store = ArtifactStore(str(root / "store"))
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

    # night 3: trained on the snapshot → better, promoted; night 1 becomes previous-champion
    state, message = run_night(server, 3)
    assert state == "COMPLETED", message
    record, pairs = gate_of(root, 3)
    assert record["verdict"] == "pass" and pairs is not None
    b, c = pairs
    assert c > b and mcnemar_exact(b, c) < ALPHA  # the paired answers say: better
    assert aliases(server) == {"champion": "3", "previous-champion": "1"}
    assert champion_digest(root) == champion_digest(root, "3") != night1  # serving follows

    # rollback: night 1's version serves again, recorded, announced
    out = _verl(env, "rollback", NAME, "--store", str(root / "store"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{NAME} rolled back: version 1 is the champion (was version 3)"
    assert aliases(server) == {"champion": "1"}
    assert champion_digest(root) == night1  # serving follows the rollback
    events = promoted_events(api, 3)
    assert [(e["payload"]["version"], e["payload"]["by"]) for e in events] == [
        ("1", "gate"),
        ("3", "gate"),
        ("1", "rollback"),
    ]
