"""A Prefect server on 127.0.0.1, past the first run (issue 39): a schedule creates flow runs and a
worker completes one; ``prefect deploy --all`` without the team variables leaves nothing that fires on
its own; the Run form shows the config file's values and a field changed there applies on top of the
file, the flow run recording it as an override (:mod:`flows.deployments`).

One server for the module (~2-3 minutes on 2 cores: ``prefect deploy --all`` imports every flow, the
form's run is a tiny quickstart pipeline). The process helpers are those of ``test_deployments``."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.deployments import form_overrides, team_settings
from tests.prefect_server import TERMINAL, Processes, _api, _free_port, _state
from verl_core.config import VerlFlowConfig, load_config

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin"
PREFECT = str(BIN / "prefect")
TEAM = ("VERL_FLOW_STORE_URL", "MLFLOW_TRACKING_URI", "VERL_FLOW_DATA_PREFIX")
pytestmark = pytest.mark.deployments

Server = tuple[dict[str, str], Processes, str]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A Prefect server whose clients have none of the team variables (one machine)."""
    tmp = tmp_path_factory.mktemp("prefect")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if k not in TEAM}
    env |= {
        "PREFECT_HOME": str(tmp / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "VERL_FLOW_HOME": str(REPO),
    }
    procs = Processes(env, tmp)
    try:
        procs.start_server(port, api)
        yield env, procs, api
    finally:
        procs.stop_all()


def _cli(env: dict[str, str], *args: str, cwd: Path = REPO, timeout: float = 180) -> str:
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def _deployments(api: str) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for d in _api(api, "/deployments/filter", {}):
        found.setdefault(d["name"], []).append(d)
    return found


def _runs_of(api: str, deployment_id: str, *states: str) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"deployments": {"id": {"any_": [deployment_id]}}}
    if states:
        body["flow_runs"] = {"state": {"type": {"any_": list(states)}}}
    return list(_api(api, "/flow_runs/filter", body))


def _final(api: str, flow_run_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while (state := _state(api, flow_run_id)) not in TERMINAL:
        assert time.monotonic() < deadline, f"flow run still {state} after {timeout:g} s"
        time.sleep(1)
    return str(state)


def test_an_interval_schedule_creates_runs_and_a_worker_completes_one(server: Server, tmp_path: Path) -> None:
    """The scheduler service inserts the schedule's runs (with SQLAlchemy 2.1 under Prefect 3.8.8 it
    failed every loop: no run, the error only in the server's log); a worker completes the first."""
    env, procs, api = server
    (tmp_path / "tick.py").write_text(
        "from prefect import flow\n\n\n@flow\ndef tick() -> int:\n    return 1\n"
    )
    project = {
        "name": "ticks",
        "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": str(tmp_path)}}],
        "deployments": [
            {
                "name": "every-5s",
                "entrypoint": "tick.py:tick",
                "work_pool": {"name": "ticks"},
                "schedules": [{"interval": 5}],
            }
        ],
    }
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump(project))
    _cli(env, PREFECT, "work-pool", "create", "ticks", "--type", "process")
    _cli(env, PREFECT, "--no-prompt", "deploy", "--all", cwd=tmp_path)
    [deployment] = _deployments(api)["every-5s"]
    deadline = time.monotonic() + 60  # the recent-deployments scheduler looks every 5 s
    while len(scheduled := _runs_of(api, deployment["id"], "SCHEDULED")) < 2:
        if time.monotonic() > deadline:
            server_log = (procs.logs / "server.log").read_text(errors="replace")
            errors = [line for line in server_log.splitlines() if "Error" in line][-5:]
            pytest.fail(f"{len(scheduled)} scheduled runs 60 s after deploying; the server says: {errors}")
        time.sleep(1)
    # one polling pass: the worker takes the run due first and waits for it (--limit 1)
    _cli(env, PREFECT, "worker", "start", "--pool", "ticks", "--run-once", "--limit", "1", cwd=tmp_path)
    done = _runs_of(api, deployment["id"], "COMPLETED")
    assert len(done) == 1, [r["state_type"] for r in _runs_of(api, deployment["id"])]
    assert done[0]["auto_scheduled"] is True


@pytest.fixture(scope="module")
def deployed(server: Server) -> dict[str, list[dict[str, Any]]]:
    """The README's one-machine recipe: the pools, then ``prefect deploy --all`` without the team
    variables."""
    env, _, api = server
    _cli(env, "bash", str(REPO / "infra/prefect/create_pools.sh"), "1")
    _cli(env, PREFECT, "--no-prompt", "deploy", "--all", timeout=300)
    return _deployments(api)


def test_deploy_all_without_the_team_variables_leaves_nothing_that_fires(
    server: Server, deployed: dict[str, list[dict[str, Any]]]
) -> None:
    _, _, api = server
    needs = {"gsm8k-ppo": TEAM[:2], "nightly-retrain": TEAM, "fork": TEAM[:2]}  # deployments mode
    for name, variables in needs.items():
        [d] = deployed[name]
        unset = ", ".join(variables)
        expected = f"NOT CONFIGURED: {unset} unset at deploy time, schedule and automation off"
        assert d["description"].split(". ")[0] == expected
        # the form's values: the file alone, its empty overrides do not validate
        assert d["parameters"]["config"]["execution"]["mode"] == "local"
    for name in ("rescore", "replay", "serve-model"):  # an empty store_url: the worker's ./runs
        [d] = deployed[name]
        assert d["description"].startswith("LOCAL STORE: VERL_FLOW_STORE_URL unset at deploy time")
        assert d["parameters"]["store_url"] == ""
    for name in ("quickstart", "sft-stage", "rl-loop-stage", "export-stage"):  # ready on one machine
        [d] = deployed[name]  # one deployment per name: the stage flows' names say which stage
        assert not d["description"].startswith("NOT CONFIGURED")
    # nothing fires on its own: the nightly schedule is off, the rescore automation disabled
    [nightly] = deployed["nightly-retrain"]
    assert [(s["schedule"]["cron"], s["active"]) for s in nightly["schedules"]] == [("0 3 * * *", False)]
    ours = [d for name, ds in deployed.items() if name != "every-5s" for d in ds]  # not the test's above
    assert not [s for d in ours for s in d["schedules"] if s["active"]]
    automations = {a["name"]: a for a in _api(api, "/automations/filter", {})}
    assert sorted(automations) == ["rescore-on-verifier-published", "serve-on-model-promoted"]
    assert not [a for a in automations.values() if a["enabled"]]
    assert "verl-flow.verifier.published" in automations["rescore-on-verifier-published"]["description"]
    assert "verl-flow.model.promoted" in automations["serve-on-model-promoted"]["description"]


def test_a_run_form_edit_applies_on_top_of_the_config_file(
    server: Server, deployed: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The form's values are the deployment's ``config`` parameter, the file resolved; what it sends
    back (the whole config, one field changed) runs as the file + that field, recorded as overrides."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env, _, api = server
    [quickstart] = deployed["quickstart"]
    shown = quickstart["parameters"]["config"]
    assert shown == load_config(REPO / "configs/quickstart.yaml").model_dump(mode="json")
    # the file's values, not the class defaults (quickstart.yaml: 4000 problems, lr 6e-5, early stops)
    assert shown["data"]["arithmetic_train_size"] == 4000 != VerlFlowConfig().data.arithmetic_train_size
    assert shown["actor"]["lr"] == 6e-5 != VerlFlowConfig().actor.lr

    form = json.loads(json.dumps(shown))
    form["trainer"]["total_iterations"] = 1  # the one field the user changes (the file says 20)
    fast = [  # the form's overrides field: a tiny, quick run on the test's own store
        "data.arithmetic_train_size=64", "data.arithmetic_val_size=8",
        "sft.max_steps=2", "sft.batch_size=8", "trainer.val_before_train=false", "data.train_batch_size=8",
        "rollout.n=2", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8", "export.enable=false",
        "tracking.enabled=false", f"store.url={tmp_path / 'store'}",
    ]  # fmt: skip
    parameters = {"config": form, "overrides": fast, "run_id": "form-edit"}
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(quickstart["id"], parameters=parameters)
    worker = _cli(env, PREFECT, "worker", "start", "--pool", "cpu", "--run-once", "--limit", "1", timeout=420)
    assert _final(api, str(flow_run.id), 30) == "COMPLETED", worker[-4000:]

    recorded = _api(api, "/flow_runs/filter", {"flow_runs": {"id": {"any_": [str(flow_run.id)]}}})[0]
    assert recorded["parameters"] == {
        "config_file": "configs/quickstart.yaml",
        "overrides": [*fast, "trainer.total_iterations=1"],
        "run_id": "form-edit",
    }
    run = json.loads((tmp_path / "store" / "runs" / "form-edit" / "run.json").read_text())["config"]
    assert run["trainer"]["total_iterations"] == 1
    assert run["actor"]["lr"] == 6e-5 and run["data"]["arithmetic_stop_early"] == 0.6  # the file's


# ------------------------------------------------------------------------------ no server
def test_form_overrides_are_the_changed_leaves() -> None:
    shown = load_config(REPO / "configs/quickstart.yaml")
    raw = shown.model_dump(mode="json")
    raw["trainer"]["total_iterations"] = 3
    raw["data"]["train_files"] = ["a.jsonl"]
    raw["parent"] = {"run_id": "r", "iteration": 2}
    submitted = VerlFlowConfig.model_validate(raw)
    # one override per changed leaf; a section that was None is set whole (as JSON, read as YAML)
    assert form_overrides(submitted, shown) == [
        'data.train_files=["a.jsonl"]',
        "trainer.total_iterations=3",
        'parent={"run_id": "r", "iteration": 2, "replay": false, "rewards": null}',
    ]
    assert form_overrides(shown, shown) == []


def test_team_settings_name_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_FLOW_STORE_URL", "s3://bucket/team")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # empty counts as unset
    assert team_settings(["VERL_FLOW_STORE_URL"]) == {"enabled": True, "note": ""}
    local = team_settings(["MLFLOW_TRACKING_URI"], local=True)
    assert local["note"].startswith("LOCAL STORE: MLFLOW_TRACKING_URI unset at deploy time")
    missing = team_settings(["VERL_FLOW_STORE_URL", "MLFLOW_TRACKING_URI"])
    assert missing["enabled"] is False and missing["note"].startswith(
        "NOT CONFIGURED: MLFLOW_TRACKING_URI unset"
    )
