"""Run untrusted Python with limits: bubblewrap, or (only when asked for) a weaker plain subprocess.

The interface the tool registry and the code scorer use::

    from verl_core.runtime.sandbox import SandboxSpec, check_sandbox, run_python, python_tool

    spec = SandboxSpec(check_sandbox(allow_weak=False), timeout_s=5, cpu_time_s=5, memory_mb=512,
                       max_processes=32, max_output_bytes=16384, max_file_mb=16)
    result = run_python("print(6 * 7)", spec)   # SandboxResult(stdout='42\\n', exit_code=0, ...)
    python_tool("print(6 * 7)", spec)           # '42\\n': the text the model sees

:func:`run_python` never raises for what the code does: a timeout, a crash, a limit hit are all in the
returned :class:`SandboxResult` (``killed_reason`` says which). :func:`check_sandbox` is the environment
check to call where a scorer or tool that needs the sandbox is built: it raises
:class:`SandboxUnavailableError` with the fix when bubblewrap cannot run and the weak fallback is not
allowed.

**bwrap backend** (what the code sees)::

    bwrap --unshare-all --unshare-user --disable-userns --uid 65534 --gid 65534 --cap-drop ALL
          --die-with-parent --new-session --clearenv --setenv PATH /usr/bin --ro-bind /usr /usr
          --symlink usr/bin /bin --symlink usr/lib /lib --symlink usr/lib64 /lib64
          --proc /proc --dev /dev --size <max_file_mb> --tmpfs /tmp --bind <fresh temp dir> /work
          --chdir /work /usr/bin/python3 -I -S -c <bootstrap>

No network (a new, empty network namespace: not even the host's 127.0.0.1), no host processes (new pid
namespace), no environment but ``PATH`` (so no secrets), and of the host's files only ``/usr``
read-only: no ``/etc`` (so no ``/etc/passwd``), ``/home``, ``/root``, ``/work`` of the host or any
other path. The interpreter is Debian's plain ``/usr/bin/python3`` with ``-I -S`` (isolated mode, no
site-packages): the project's virtual environment is not visible, only the standard library. When
verl-flow runs as root, bwrap is started as uid/gid 65534 (nobody) with no supplementary groups, so
that its user namespace maps to an unprivileged user: the kernel does not enforce ``RLIMIT_NPROC`` for
processes of real uid 0, and a fork bomb would not be contained.

**Limits** (both backends): a bootstrap sets hard rlimits, then ``exec``s the code as ``main.py``:
``RLIMIT_CPU`` (CPU seconds: SIGXCPU, then SIGKILL one second later), ``RLIMIT_AS`` (address space),
``RLIMIT_FSIZE`` (bytes of one file), ``RLIMIT_NPROC`` (processes; the kernel counts all processes of
the real user, so the limit is the user's count at start plus ``max_processes``: sandboxes running at
once under one user share that headroom) and ``RLIMIT_CORE`` 0. The code cannot raise a hard limit.
The parent kills the process group at ``timeout_s`` of wall clock, and as soon as stdout or stderr
passes ``max_output_bytes`` (the first ``max_output_bytes`` are kept, ``truncated`` is set). bwrap's
pid namespace ends every process of the sandbox when it is killed. Files the code writes go to its
working dir (a host temp dir, removed after the run) or ``/tmp`` (a tmpfs of ``max_file_mb``).

**weak backend** (``sandbox.allow_weak_sandbox: true`` only): the same interpreter, bootstrap and
limits in a plain subprocess with an empty environment (``PATH`` only), a fresh temp dir as the working
dir and a new session, as uid 65534 when verl-flow runs as root. It does NOT isolate the network (the
code can connect anywhere, 127.0.0.1 included), file-system reads (every file the user may read, and
unless verl-flow runs as root, ``/proc/<pid>/environ`` of the user's processes: verl-flow's secrets), or
the host's processes (visible in ``/proc``; a child that calls ``setsid`` escapes the wall-clock kill).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Literal, NamedTuple

from verl_core.errors import VerlFlowError

log = logging.getLogger(__name__)

Backend = Literal["bwrap", "weak"]
NOBODY = 65534  # uid/gid the sandbox runs as when verl-flow runs as root, and the uid inside bwrap
_POLL_S = 0.02


class SandboxUnavailableError(VerlFlowError):
    """bubblewrap cannot run here and the weak fallback is not allowed; the message names the fix."""


class SandboxSpec(NamedTuple):
    """Where and under which limits code runs (``sandbox.*`` of the config, backend resolved)."""

    backend: Backend
    timeout_s: float  # wall clock, then the process group is killed
    cpu_time_s: int  # RLIMIT_CPU
    memory_mb: int  # RLIMIT_AS
    max_processes: int  # RLIMIT_NPROC on top of the user's processes at start
    max_output_bytes: int  # kept of stdout and of stderr each; more kills the run
    max_file_mb: int  # RLIMIT_FSIZE, and the size of the sandbox's /tmp


class SandboxResult(NamedTuple):
    """What one run did. ``exit_code``: the interpreter's exit status, ``-N`` when signal N ended it.
    ``killed_reason``: None, or ``"timeout"``, ``"output limit"``, ``"cpu time limit"``,
    ``"memory limit"``, ``"process limit"``, ``"file size limit"``, ``"signal N"``,
    ``"sandbox failed: ..."`` (the sandbox itself could not start)."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    killed_reason: str | None
    duration_s: float
    truncated: bool


# --------------------------------------------------------------------------------------------------
# The environment check


def sandbox_python() -> str:
    """The interpreter the sandbox runs: Debian's plain ``/usr/bin/python3`` (under the read-only
    ``/usr`` bind; the project's venv may live where uid 65534 cannot read), else this interpreter."""
    return "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else os.path.realpath(sys.executable)


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot run a sandboxed interpreter here (None: it can). Probed once per process."""
    if shutil.which("bwrap") is None:
        return "bwrap (bubblewrap) is not installed"
    if sandbox_python() != "/usr/bin/python3":
        return "/usr/bin/python3 is missing (the sandbox runs the system interpreter)"
    with tempfile.TemporaryDirectory(prefix="verl-sandbox-probe-") as work:
        _give_to_sandbox_user(work)
        cmd = [*_bwrap_argv(work, max_file_mb=1), sandbox_python(), "-I", "-S", "-c", "pass"]
        try:
            who = _run_as()
            r = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=30,
                user=who.user,
                group=who.group,
                extra_groups=who.extra_groups,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap failed to start: {e}"
    if r.returncode != 0:
        return f"bwrap cannot create its namespaces here: {r.stderr.strip()[-300:]}"
    return None


def check_sandbox(allow_weak: bool) -> Backend:
    """The backend to use: ``"bwrap"`` when it runs here, else ``"weak"`` if ``allow_weak`` (with a
    warning saying what it does not isolate), else :class:`SandboxUnavailableError` naming the fix."""
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    if not allow_weak:
        raise SandboxUnavailableError(
            f"sandbox: {problem}; install it (as root: apt-get install -y bubblewrap, or `make install`), "
            "or set sandbox.allow_weak_sandbox=true to run code without isolation of network and files"
        )
    log.warning(
        "sandbox: %s; running code in the WEAK sandbox (sandbox.allow_weak_sandbox=true): a subprocess "
        "with rlimits, an empty environment and a temp working dir. It does NOT isolate the network "
        "or file-system reads: the code can connect anywhere and read every file its user can (as a user "
        "other than root, that includes the environment of that user's processes: their secrets).",
        problem,
    )
    return "weak"


# --------------------------------------------------------------------------------------------------
# Running code


def _bwrap_argv(work: str, *, max_file_mb: int) -> list[str]:
    """bwrap's command line up to the program (see the module docstring for what it leaves visible)."""
    argv = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns"]
    argv += ["--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL", "--die-with-parent"]
    argv += ["--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for d in ("bin", "lib", "lib64", "sbin"):  # merged /usr on Debian: /bin -> usr/bin ...
        if os.path.islink(f"/{d}"):
            argv += ["--symlink", os.readlink(f"/{d}"), f"/{d}"]
        elif os.path.isdir(f"/{d}"):
            argv += ["--ro-bind", f"/{d}", f"/{d}"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(max_file_mb << 20), "--tmpfs", "/tmp"]
    argv += ["--bind", work, "/work", "--chdir", "/work"]
    return argv


class _As(NamedTuple):
    """Popen's user, group, extra_groups: nobody when root, else unchanged (None). Popen does this
    without a preexec_fn, which is unsafe here: the code scorer starts sandboxes from threads."""

    user: int | None
    group: int | None
    extra_groups: list[int] | None


def _run_as() -> _As:
    return _As(NOBODY, NOBODY, []) if os.geteuid() == 0 else _As(None, None, None)


def _give_to_sandbox_user(path: str) -> None:
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)


def _processes_of(uid: int) -> int:
    """How many processes real uid ``uid`` has now (what the kernel compares with RLIMIT_NPROC)."""
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                n += os.stat(entry.path).st_uid == uid
            except OSError:
                continue
    return n


_BOOTSTRAP = """\
import os, resource as r
for k, v in (("AS", {mem}), ("FSIZE", {fsize}), ("NPROC", {nproc}), ("CORE", 0)):
    r.setrlimit(getattr(r, "RLIMIT_" + k), (v, v))
r.setrlimit(r.RLIMIT_CPU, ({cpu}, {cpu} + 1))  # SIGXCPU (reported as such), SIGKILL a second later
os.execv({py!r}, [{py!r}, "-I", "-S", "main.py"])
"""


def _bootstrap(spec: SandboxSpec, python: str) -> str:
    """Set hard rlimits, then exec the code: the limits hold for the code and everything it starts."""
    uid = NOBODY if os.geteuid() == 0 else os.getuid()
    return _BOOTSTRAP.format(
        cpu=spec.cpu_time_s,
        mem=spec.memory_mb << 20,
        fsize=spec.max_file_mb << 20,
        nproc=_processes_of(uid) + spec.max_processes,
        py=python,
    )


def _drain(stream: IO[bytes], keep: bytearray, cap: int, over: threading.Event) -> None:
    """Read ``stream`` to its end, keeping the first ``cap`` bytes; set ``over`` past the cap."""
    fd = stream.fileno()
    while chunk := os.read(fd, 65536):
        room = cap - len(keep)
        if len(chunk) > room:
            keep += chunk[: max(room, 0)]
            over.set()
        else:
            keep += chunk


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _limit_hit(exit_code: int, stderr: str, signum: int | None) -> str | None:
    """Which limit ended the code, from its exit and the tail of its stderr."""
    tail = stderr[-2000:]
    if signum == signal.SIGXCPU:
        return "cpu time limit"
    if signum == signal.SIGXFSZ or "File too large" in tail:
        return "file size limit"
    if "MemoryError" in tail or "Cannot allocate memory" in tail:
        return "memory limit"
    if "BlockingIOError" in tail or "Resource temporarily unavailable" in tail:
        return "process limit"
    if signum is not None:
        return f"signal {signum}"
    return None


def run_python(code: str, spec: SandboxSpec) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh working dir under ``spec``; never raises for what the
    code does (see :class:`SandboxResult`)."""
    python = sandbox_python()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="verl-sandbox-") as work:
        Path(work, "main.py").write_text(code)
        _give_to_sandbox_user(work)
        program = [python, "-I", "-S", "-c", _bootstrap(spec, python)]
        if spec.backend == "bwrap":
            argv, cwd = _bwrap_argv(work, max_file_mb=spec.max_file_mb) + program, None
        else:
            argv, cwd = program, work
        who = _run_as()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env={"PATH": "/usr/bin:/bin"},
                start_new_session=True,  # its own process group: the timeout kills all of it
                user=who.user,
                group=who.group,
                extra_groups=who.extra_groups,
            )
        except OSError as e:
            return SandboxResult("", "", -1, False, f"sandbox failed: {e}", time.monotonic() - start, False)
        out, err, over = bytearray(), bytearray(), threading.Event()
        readers = [
            threading.Thread(target=_drain, args=(s, b, spec.max_output_bytes, over), daemon=True)
            for s, b in ((proc.stdout, out), (proc.stderr, err))
        ]
        for t in readers:
            t.start()
        killed: str | None = None
        while proc.poll() is None:
            if over.wait(_POLL_S):
                killed = "output limit"
            elif time.monotonic() - start > spec.timeout_s:
                killed = "timeout"
            if killed:
                _kill_group(proc)
                proc.wait()
        _kill_group(proc)  # leftovers of the weak backend (bwrap's pid namespace is gone already)
        for t in readers:
            t.join(timeout=1.0)
        duration = time.monotonic() - start
    stderr = err.decode("utf-8", "replace")
    exit_code = proc.returncode
    signum = -exit_code if exit_code < 0 else None
    if spec.backend == "bwrap" and 128 < exit_code <= 128 + 64:  # bwrap reports a signal as 128 + N
        signum, exit_code = exit_code - 128, 128 - exit_code
    if killed == "timeout" and signum == signal.SIGXCPU:  # both limits at once: the CPU limit ended it
        killed = None
    if killed is None:
        killed = _limit_hit(exit_code, stderr, signum) if exit_code != 0 else None
    if killed is None and spec.backend == "bwrap" and exit_code == 1 and stderr.startswith("bwrap:"):
        killed = f"sandbox failed: {stderr.strip()}"
    return SandboxResult(
        stdout=out.decode("utf-8", "replace"),
        stderr=stderr,
        exit_code=exit_code,
        timed_out=killed == "timeout",
        killed_reason=killed,
        duration_s=duration,
        truncated=over.is_set(),
    )


# --------------------------------------------------------------------------------------------------
# The text a model sees


def format_result(result: SandboxResult, spec: SandboxSpec, *, tail_chars: int = 2000) -> str:
    """A run as the ``python`` tool's answer: stdout when it ran cleanly, else stdout plus the error
    ("timeout after 5 s", "killed: memory limit", the exit code) and the tail of stderr."""
    if result.exit_code == 0 and result.killed_reason is None:
        return result.stdout + ("\n[output truncated]" if result.truncated else "")
    if result.timed_out:
        error = f"error: timeout after {spec.timeout_s:g} s"
    elif result.killed_reason is not None:
        error = f"error: killed: {result.killed_reason}"
    else:
        error = f"error: exit code {result.exit_code}"
    parts = [result.stdout, error]
    if result.truncated:
        parts.append("[output truncated]")
    if result.stderr.strip():
        parts.append(result.stderr[-tail_chars:].rstrip())
    return "\n".join(p for p in parts if p)


def python_tool(code: str, spec: SandboxSpec) -> str:
    """The built-in ``python`` tool: run ``code`` in the sandbox, return what the model should read."""
    return format_result(run_python(code, spec), spec)
