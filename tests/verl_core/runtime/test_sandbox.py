"""The sandbox against bubblewrap: what the code must not reach (network, the host's environment and
files), what must be contained and reported (fork bomb, infinite loop, memory, output flood), and the
weak fallback only for what it claims (empty environment, limits, timeouts)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from verl_core.runtime import sandbox
from verl_core.runtime.sandbox import (
    SandboxSpec,
    SandboxUnavailableError,
    check_sandbox,
    python_tool,
    run_python,
)

BWRAP_PROBLEM = sandbox.bwrap_problem()
needs_bwrap = pytest.mark.skipif(
    BWRAP_PROBLEM is not None,
    reason=f"bubblewrap cannot run here ({BWRAP_PROBLEM}); `make install` installs it when root",
)


def spec(backend: sandbox.Backend = "bwrap", **limits: float) -> SandboxSpec:
    base = {"timeout_s": 5.0, "cpu_time_s": 5, "memory_mb": 256, "max_processes": 16}
    base |= {"max_output_bytes": 4096, "max_file_mb": 4} | limits
    return SandboxSpec(backend, **base)  # type: ignore[arg-type]


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP listener on 127.0.0.1 (random port)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


CONNECT = """
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    print("connected")
except OSError as e:
    print("refused", type(e).__name__)
"""


@needs_bwrap
def test_network_is_unreachable_from_bwrap(listener: int) -> None:
    code = CONNECT.format(port=listener)
    control = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10)
    assert control.stdout.strip() == "connected"  # the listener is reachable from outside the sandbox
    r = run_python(code, spec())
    assert r.exit_code == 0 and r.stdout.startswith("refused"), r


@needs_bwrap
def test_host_environment_is_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_SANDBOX_CANARY", "canary-7f3a9c")
    r = run_python("import os; print(sorted(os.environ))", spec())
    assert r.exit_code == 0, r
    assert "canary" not in r.stdout.lower()
    assert eval(r.stdout) == ["LC_CTYPE", "PATH", "PWD"]  # set by bwrap/python, nothing inherited


@needs_bwrap
def test_host_files_are_invisible_and_usr_is_read_only(tmp_path: Path) -> None:
    canary = tmp_path / "secret.txt"
    canary.write_text("canary-5e1d")
    canary.chmod(0o644)  # world-readable on the host: only the mount namespace keeps it out
    code = f"""
import os
for path in [{str(canary)!r}, "/etc/passwd", "/root", "/home"]:
    try:
        print(path, "read", open(path).read()[:20] if os.path.isfile(path) else os.listdir(path))
    except OSError as e:
        print(path, type(e).__name__)
try:
    open("/usr/evil", "w")
except OSError as e:
    print("/usr", type(e).__name__)
print(sorted(os.listdir("/")))
"""
    r = run_python(code, spec())
    assert r.exit_code == 0, r
    assert "canary-5e1d" not in r.stdout
    lines = r.stdout.splitlines()
    for path in [str(canary), "/etc/passwd", "/root", "/home"]:
        assert f"{path} FileNotFoundError" in lines, r.stdout
    assert "/usr OSError" in lines or "/usr PermissionError" in lines, r.stdout
    assert eval(lines[-1]) == ["bin", "dev", "lib", "lib64", "proc", "sbin", "tmp", "usr", "work"]


@needs_bwrap
def test_fork_bomb_is_contained_and_reported() -> None:
    r = run_python("import os\nwhile True:\n    os.fork()", spec(max_processes=16))
    assert r.killed_reason == "process limit", r
    assert r.duration_s < 5


@needs_bwrap
def test_infinite_loop_times_out() -> None:
    r = run_python("while True:\n    pass", spec(timeout_s=1.0))
    assert r.timed_out and r.killed_reason == "timeout", r
    assert 1.0 <= r.duration_s < 3.0


@needs_bwrap
def test_cpu_time_limit() -> None:
    r = run_python("while True:\n    pass", spec(timeout_s=10.0, cpu_time_s=1))
    assert r.killed_reason == "cpu time limit" and not r.timed_out, r


@needs_bwrap
def test_memory_blow_up_is_killed() -> None:
    r = run_python("x = bytearray(1 << 30)", spec(memory_mb=128))
    assert r.killed_reason == "memory limit" and r.exit_code != 0, r


@needs_bwrap
def test_output_flood_is_truncated() -> None:
    r = run_python("while True:\n    print('x' * 100)", spec(max_output_bytes=1000))
    assert r.truncated and r.killed_reason == "output limit", r
    assert len(r.stdout) == 1000


@needs_bwrap
def test_crash_is_a_result_and_the_tool_shows_it() -> None:
    r = run_python("1 / 0", spec())
    assert r.exit_code == 1 and r.killed_reason is None and "ZeroDivisionError" in r.stderr
    assert python_tool("print(6 * 7)", spec()) == "42\n"
    text = python_tool("1 / 0", spec())
    assert text.startswith("error: exit code 1\n") and text.endswith("ZeroDivisionError: division by zero")
    assert python_tool("while True: pass", spec(timeout_s=0.5)) == "error: timeout after 0.5 s"
    assert python_tool("x = bytearray(1 << 30)", spec(memory_mb=128)).startswith(
        "error: killed: memory limit"
    )


def test_missing_bwrap_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bwrap (bubblewrap) is not installed")
    with pytest.raises(
        SandboxUnavailableError, match=r"apt-get install -y bubblewrap.*allow_weak_sandbox=true"
    ):
        check_sandbox(allow_weak=False)
    with caplog.at_level(logging.WARNING, logger="verl_core.runtime.sandbox"):
        assert check_sandbox(allow_weak=True) == "weak"
    assert "does NOT isolate the network or file-system reads" in caplog.text


# --------------------------------------------------------------------------------------------------
# The weak fallback: only what it claims


def test_weak_environment_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_SANDBOX_CANARY", "canary-7f3a9c")
    r = run_python("import os; print(sorted(os.environ))", spec("weak"))
    assert r.exit_code == 0, r
    assert eval(r.stdout) == ["LC_CTYPE", "PATH"]


def test_weak_limits_and_timeout() -> None:
    assert run_python("while True:\n    pass", spec("weak", timeout_s=1.0)).killed_reason == "timeout"
    assert run_python("x = bytearray(1 << 30)", spec("weak", memory_mb=128)).killed_reason == "memory limit"
    bomb = run_python("import os\nwhile True:\n    os.fork()", spec("weak", max_processes=16))
    assert bomb.killed_reason == "process limit", bomb
    flood = run_python("while True:\n    print('x' * 100)", spec("weak", max_output_bytes=1000))
    assert flood.truncated and len(flood.stdout) == 1000
    if os.geteuid() == 0:  # root drops to nobody
        assert run_python("import os; print(os.getuid())", spec("weak")).stdout == "65534\n"
