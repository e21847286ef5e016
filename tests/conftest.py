"""Shared fixtures: quiet offline environment, a local S3-compatible endpoint (moto server)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from verl_core.runtime.env import set_quiet_env

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's temporary Prefect servers on a database of its own
    import tempfile

    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"prefect-{os.environ['PYTEST_XDIST_WORKER']}-")
set_quiet_env(offline=True)

# MLflow's variables that say where runs land (the pipeline honours the first two when tracking.uri /
# the project name are unset, as MLflow does; MLflow reads the others itself): a developer's shell
# with them set would send the tests' runs to its server or experiment and change their assertions.
# Cleared for the whole session, subprocesses included; a test that needs one sets it (monkeypatch).
MLFLOW_WHERE_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_RUN_ID",
    "MLFLOW_REGISTRY_URI",
    "MLFLOW_ARTIFACT_URI",
    "MLFLOW_DEFAULT_ARTIFACT_ROOT",
    "MLFLOW_TRACKING_DIR",
)
for _name in MLFLOW_WHERE_ENV:
    os.environ.pop(_name, None)

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "verl-flow-test",
    "AWS_SECRET_ACCESS_KEY": "verl-flow-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (random port) for the whole session; sets the AWS_* variables
    that the artifact store reads the endpoint and credentials from."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL_S3"]}
    os.environ.update(S3_ENV)
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket; returns its ``s3://`` URL."""
    import boto3

    name = f"verl-flow-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return f"s3://{name}"


# tests/vllm runs inside the vLLM environment (`make pytest-vllm`): vllm does not import here.
import importlib.util  # noqa: E402

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm"]


# The suite's longest files (a minute or more each on 2 cores), longest first. `make pytest` hands
# whole files to its two pytest-xdist workers in collection order (--dist loadfile
# --no-loadscope-reorder; xdist's own reorder puts the files with the most tests first, which left
# the two longest, one test each, to the end, the other worker idle meanwhile). Every other file
# keeps its place after these.
LONGEST_FIRST = (
    "tests/flows/test_nightly_gate.py",
    "tests/flows/test_deployments.py",
    "tests/reliability/test_determinism.py",
    "tests/reliability/test_crash_resume.py",
    "tests/reliability/test_replay_fork.py",
    "tests/reliability/test_server_restart.py",
    "tests/reliability/test_store_outage.py",
    "tests/flows/test_serving.py",
    "tests/browse/test_browser.py",
    "tests/flows/test_gate_flow.py",
    "tests/flows/test_prefect_ui_browser.py",
    "tests/stages/test_gate.py",
    "tests/reliability/test_disk_full.py",
    "tests/reliability/test_spmd.py",
    "tests/flows/test_pipeline_vllm.py",
    "tests/verl_core/rollout/test_vllm_process.py",
    "tests/verl_core/rollout/test_multi_turn.py",
    "tests/stages/test_ppo_update.py",
    "tests/flows/test_cli_run.py",
    "tests/verl_core/training/test_fsdp.py",
    "tests/flows/test_pipeline.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    # a stable sort: the files stay whole, their tests in order
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
