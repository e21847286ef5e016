"""``verl-flow serve``: a run's latest export (or a model directory) behind vLLM's OpenAI-compatible
server (:mod:`flows.serving`); the options' defaults and help are :class:`ServeConfig`'s, vLLM's those of
the ``rollout`` section (:class:`RolloutConfig`), by its names and types."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from flows.cli.common import StoreOpt, fail, out
from verl_core.config import RolloutConfig, StoreConfig
from verl_core.errors import ConfigError, VerlFlowError
from verl_core.runtime.serving import ServeConfig, curl_example


def _serve_help(name: str) -> str:
    return ServeConfig.model_fields[name].description or ""


def _rollout_help(name: str) -> str:
    return f"rollout.{name}: {RolloutConfig.model_fields[name].description or ''}"


_SERVE = ServeConfig()  # `serve`'s option defaults are ServeConfig's (verl_core/runtime/serving.py)
_VLLM = _SERVE.rollout  # vLLM's: the rollout section's, by its names
VLLM_OPTIONS = (
    "tensor_parallel_size", "gpu_memory_utilization", "kv_cache_gib", "cpu_kv_cache_gib",
    "vllm_enforce_eager", "vllm_python",
)  # fmt: skip


def serve_cmd(
    target: Annotated[
        str, typer.Argument(help="Run id (its latest export) or an exported HF model directory")
    ],
    host: Annotated[str, typer.Option(help=_serve_help("host"))] = _SERVE.host,
    port: Annotated[int, typer.Option(help=_serve_help("port"))] = _SERVE.port,
    served_model_name: Annotated[
        str | None, typer.Option(help=_serve_help("served_model_name"))
    ] = _SERVE.served_model_name,
    dtype: Annotated[str, typer.Option(help=_serve_help("dtype"))] = _SERVE.dtype,
    max_model_len: Annotated[
        int | None, typer.Option(help=_serve_help("max_model_len"))
    ] = _SERVE.max_model_len,
    health_timeout_s: Annotated[
        float, typer.Option(help=_serve_help("health_timeout_s"))
    ] = _SERVE.health_timeout_s,
    tensor_parallel_size: Annotated[
        int, typer.Option(help=_rollout_help("tensor_parallel_size"))
    ] = _VLLM.tensor_parallel_size,
    gpu_memory_utilization: Annotated[
        float, typer.Option(help=_rollout_help("gpu_memory_utilization"))
    ] = _VLLM.gpu_memory_utilization,
    kv_cache_gib: Annotated[
        float | None, typer.Option(help=_rollout_help("kv_cache_gib"))
    ] = _VLLM.kv_cache_gib,
    cpu_kv_cache_gib: Annotated[
        float, typer.Option(help=_rollout_help("cpu_kv_cache_gib"))
    ] = _VLLM.cpu_kv_cache_gib,
    vllm_enforce_eager: Annotated[
        bool, typer.Option(help=_rollout_help("vllm_enforce_eager"))
    ] = _VLLM.vllm_enforce_eager,
    vllm_python: Annotated[str, typer.Option(help=_rollout_help("vllm_python"))] = _VLLM.vllm_python,
    detach: Annotated[
        bool, typer.Option("--detach", help="Leave the server running in the background and return")
    ] = False,
    store: StoreOpt = None,
) -> None:
    """Serve TARGET with vLLM's OpenAI-compatible server (vLLM environment: make .venv-vllm): waits for
    /health, prints the URL and a curl line, then runs until Ctrl-C (or --detach)."""
    import shutil
    import tempfile

    from pydantic import ValidationError

    from flows.serving import resolve_model, serve

    settings = dict(locals())
    try:
        rollout = RolloutConfig(**{k: settings[k] for k in VLLM_OPTIONS})
        own = {k: settings[k] for k in ServeConfig.model_fields if k in settings}
        cfg = ServeConfig(**own, rollout=rollout)
    except ValidationError as e:
        fail(e, 2, one_line=False)
    workdir = tempfile.mkdtemp(prefix="verl-flow-serve-")
    try:
        model = resolve_model(target, store or StoreConfig().url, workdir)
        out.print(f"starting vLLM on {model.model_dir} (log {workdir}/server.log) ...", highlight=False)
        handle = serve(model, cfg, f"{workdir}/server.log")
    except ConfigError as e:
        fail(e, 2)
    except VerlFlowError as e:
        fail(e, 1, one_line=False)
    out.print(f"serving {handle.model} at {handle.url}/v1 (OpenAI-compatible)", highlight=False)
    sys.stdout.write(curl_example(handle) + "\n")
    sys.stdout.flush()
    if detach:
        out.print(f"detached: pid {handle.process.pid}; stop with kill -TERM -{handle.process.pid}")
        return
    try:
        code = handle.wait()
    except KeyboardInterrupt:
        handle.stop()
        shutil.rmtree(workdir, ignore_errors=True)  # the written-out export and the log
        out.print("stopped")
        return
    fail(
        f"the vLLM server exited with code {code}; log {handle.log_path}:\n{handle.log_tail()}",
        1,
        one_line=False,
    )
