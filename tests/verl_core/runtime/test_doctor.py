"""verl_core.runtime.doctor: package ranges and cross-package pins from metadata, the torch build, store and
MLflow reachability. Versions are simulated by replacing the two metadata lookups."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from verl_core.errors import ConfigError
from verl_core.runtime import doctor
from verl_core.runtime.doctor import Check, package_checks, problems, require
from verl_core.runtime.reachability import store_check, tracking_check

REAL_VERSION = doctor.installed_version
REAL_REQUIRES = doctor.declared_requirements


def fake_env(
    monkeypatch: pytest.MonkeyPatch,
    versions: dict[str, str | None],
    requires: dict[str, list[str]] | None = None,
) -> None:
    """Report ``versions`` (None: not installed) and ``requires`` instead of the installed metadata."""
    reqs = requires or {}
    monkeypatch.setattr(
        doctor, "installed_version", lambda d: versions[d] if d in versions else REAL_VERSION(d)
    )
    monkeypatch.setattr(doctor, "declared_requirements", lambda d: reqs[d] if d in reqs else REAL_REQUIRES(d))


def by_name(checks: list[Check], name: str) -> Check:
    return next(c for c in checks if c.name == name)


def test_this_machine_has_no_package_problems() -> None:
    checks = package_checks()
    assert problems(checks) == [], [c.line() for c in problems(checks)]
    torch_row = by_name(checks, "torch")
    assert torch_row.found == REAL_VERSION("torch")
    assert torch_row.expected == ">=2.6"  # pyproject's range, read from the installed metadata
    assert by_name(checks, "transformers").expected == ">=5.16.1,<5.24"  # lower bound first


def test_torch_below_the_declared_range_is_an_error_with_the_pip_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_env(monkeypatch, {"torch": "2.5.1"})
    row = by_name(package_checks(), "torch")
    assert row.status == "error"
    assert row.line() == "torch: 2.5.1 (expected >=2.6 (required)); fix: pip install 'torch>=2.6'"
    with pytest.raises(ConfigError, match=r"^torch: 2\.5\.1 .*fix: pip install 'torch>=2\.6'$"):
        require()


def test_vllm_metadata_pin_is_checked_against_installed_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's wheel says torch==2.9.0; torch 2.13 is installed: the pin comes from vLLM's metadata.
    vllm_requires = ["torch==2.9.0", "transformers>=4.56", "pytest; extra == 'test'"]
    fake_env(monkeypatch, {"vllm": "0.11.0", "torch": "2.13.0+cpu"}, {"vllm": vllm_requires})
    errors = problems(package_checks())
    assert [c.name for c in errors] == ["torch for vllm"]
    (row,) = errors
    assert row.found == "2.13.0+cpu" and row.expected == "torch==2.9.0 (vllm 0.11.0)"
    assert row.fix.startswith("pip install 'torch==2.9.0' (vllm 0.11.0 declares it)")
    with pytest.raises(ConfigError, match=r"torch for vllm: .*pip install 'torch==2\.9\.0'"):
        require({"vllm": "rollout.name: 'vllm'"})


def test_optional_packages_warn_unless_the_config_needs_them(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_env(monkeypatch, {"deepspeed": None, "vllm": None})
    plain = package_checks()
    assert by_name(plain, "deepspeed").status == "warn"
    assert problems(plain) == []
    needed = by_name(package_checks({"deepspeed": "actor.strategy: 'deepspeed'"}), "deepspeed")
    assert needed.line() == (
        "deepspeed: not installed (expected >=0.19, needed by actor.strategy: 'deepspeed'); "
        "fix: pip install 'verl-flow[deepspeed]'"
    )


def test_installed_optional_package_below_its_extra_range(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_env(monkeypatch, {"bitsandbytes": "0.44.0"})
    assert by_name(package_checks(), "bitsandbytes").status == "warn"  # not needed: a warning
    row = by_name(package_checks({"bitsandbytes": "model.quantization"}), "bitsandbytes")
    assert row.status == "error" and row.fix == "pip install 'bitsandbytes>=0.45'"


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks a CPU build of torch")
def test_cuda_asked_of_a_cpu_torch_build_fails_with_the_fix() -> None:
    with pytest.raises(ConfigError) as e:
        require(cuda_needed_by="trainer.device: 'cuda'")
    (line,) = str(e.value).splitlines()
    assert (
        line.startswith("torch CUDA build: torch ") and "is a CPU build (torch.version.cuda is None)" in line
    )
    assert "fix: pip install torch==" in line and "--index-url https://download.pytorch.org/whl/cu" in line


def test_require_is_cheap() -> None:
    t0 = time.perf_counter()
    for _ in range(5):
        require()
    assert (time.perf_counter() - t0) / 5 < 0.5  # metadata reads only (~35 ms here)


# ------------------------------------------------------------------------------------ reachability
def test_local_store_and_sqlite_tracking(tmp_path: Path) -> None:
    assert store_check(str(tmp_path / "new" / "runs")).status == "ok"  # nearest parent writable
    assert tracking_check(None, str(tmp_path)).found == f"sqlite:///{tmp_path}/mlflow.db writable"
    assert not (tmp_path / "new").exists()  # the doctor creates nothing
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    row = store_check(str(blocker / "runs"))
    assert row.status == "error" and row.fix.startswith("store.url:")


def test_file_tracking_store_needs_mlflow_opt_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    row = tracking_check(f"file://{tmp_path}/mlruns", str(tmp_path))
    assert row.status == "error" and "MLFLOW_ALLOW_FILE_STORE=true" in row.fix


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def test_unreachable_s3_endpoint_fails_within_the_timeout(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{silent_port}")
    t0 = time.perf_counter()
    row = store_check("s3://bucket/prefix", timeout_s=1.0)
    assert time.perf_counter() - t0 < 5
    assert row.status == "error"
    assert f"http://127.0.0.1:{silent_port}" in row.fix and "AWS_ENDPOINT_URL_S3" in row.fix


def test_reachable_s3_store(s3_bucket: str) -> None:
    assert store_check(f"{s3_bucket}/runs").status == "ok"
    missing = store_check("s3://no-such-bucket-here/runs")
    assert missing.status == "error" and "does not exist" in missing.found


def test_mlflow_server_not_answering_fails_within_the_timeout(silent_port: int) -> None:
    t0 = time.perf_counter()
    row = tracking_check(f"http://user:secret@127.0.0.1:{silent_port}", "runs", timeout_s=1.0)
    assert time.perf_counter() - t0 < 5
    assert row.status == "error" and "secret" not in row.line()


def test_sandbox_check_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_core.runtime import sandbox

    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bwrap (bubblewrap) is not installed")
    [error] = doctor.sandbox_checks("reward.scorers: 'code'", allow_weak=False)
    assert error.status == "error" and "apt-get install -y bubblewrap" in error.fix
    assert "sandbox.allow_weak_sandbox=true" in error.fix
    [warn] = doctor.sandbox_checks("reward.scorers: 'code'", allow_weak=True)
    assert warn.status == "warn" and "no network or file isolation" in warn.found
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: None)
    assert doctor.sandbox_checks("x", allow_weak=False)[0].status == "ok"


# ------------------------------------------------------------------------------------ /dev/shm
GiB = 1 << 30


def test_shm_smaller_than_a_weight_sync_warns_with_the_docker_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_core.rollout import weight_sync

    # Docker's default /dev/shm (64 MiB), a 0.5B model in bf16 (~1 GiB)
    monkeypatch.setattr(weight_sync, "shm_space", lambda: (64 << 20, 64 << 20))
    [row] = doctor.shm_checks(GiB, "rollout.name: 'vllm'")
    assert row.status == "warn" and row.name == "/dev/shm"
    assert row.found == "64 MiB free of 64 MiB"
    assert row.expected == "≥ 1,088 MiB to stage 1,024 MiB of weights (rollout.name: 'vllm')"  # + 1/16
    assert "--shm-size" in row.fix and "--ipc=host" in row.fix and "emptyDir" in row.fix
    # the model's size unknown here: held to the 1 GiB floor (the smallest GPU model we sync)
    assert doctor.shm_checks(None, "x")[0].status == "warn"
    # `docker run --ipc=host` on a 2 TB host: room
    monkeypatch.setattr(weight_sync, "shm_space", lambda: (900 * GiB, 1000 * GiB))
    [row] = doctor.shm_checks(GiB, "rollout.name: 'vllm'")
    assert (row.status, row.fix) == ("ok", "")
    assert doctor.shm_checks(None, "x")[0].status == "ok"
    monkeypatch.setattr(weight_sync, "shm_space", lambda: None)  # no /dev/shm: the temp directory
    assert doctor.shm_checks(GiB, "x")[0].status == "ok"
