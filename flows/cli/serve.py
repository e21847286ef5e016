"""``verl-flow serve``: a registered model version (``models:/NAME@champion``), a run's latest export
or a model directory behind vLLM's OpenAI-compatible server (:mod:`flows.serving`); the options'
defaults and help are :class:`ServeConfig`'s, vLLM's those of the ``rollout`` section
(:class:`RolloutConfig`), by its names and types.

``serve`` is a group: ``serve status [NAME]`` and ``serve stop [NAME]`` read the records of the
servers started on this machine (:mod:`verl_core.runtime.serve_records`), and anything else after
``serve`` is ``serve start``'s (``verl-flow serve TARGET --port P`` is ``verl-flow serve start TARGET
--port P``; a model directory named ``status`` or ``stop`` is given as ``./status``)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from flows.cli.common import JsonOpt, StoreOpt, fail, out, print_json, print_table
from verl_core.config import RolloutConfig, StoreConfig
from verl_core.errors import ConfigError, VerlFlowError
from verl_core.runtime import serve_records as records
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


class _StartByDefault(TyperGroup):
    """``serve X ...`` is ``serve start X ...`` unless X is a subcommand (status, stop) or --help."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["start", *args]
        return super().parse_args(ctx, args)


serve_app = typer.Typer(
    cls=_StartByDefault,
    no_args_is_help=True,
    help="Serve a model with vLLM's OpenAI-compatible server: `verl-flow serve TARGET` (= serve start "
    "TARGET); `serve status` and `serve stop` list and stop the servers started on this machine.",
)


@serve_app.command("start")
def serve_cmd(
    target: Annotated[
        str,
        typer.Argument(
            help="models:/NAME@ALIAS or models:/NAME/VERSION (MLflow's registry), a run id (its latest "
            "export) or an exported HF model directory"
        ),
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
    tool_call_parser: Annotated[
        str | None, typer.Option(help=_serve_help("tool_call_parser"))
    ] = _SERVE.tool_call_parser,
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
        bool,
        typer.Option("--detach", help="Leave the server running in the background and return (serve stop)"),
    ] = False,
    replace: Annotated[
        bool, typer.Option("--replace", help="Stop the server already serving this name first")
    ] = False,
    tracking_uri: Annotated[
        str | None,
        typer.Option(
            help="MLflow registry of models:/ targets (default: $MLFLOW_TRACKING_URI, else the store's)"
        ),
    ] = None,
    store: StoreOpt = None,
) -> None:
    """Serve TARGET with vLLM's OpenAI-compatible server (vLLM environment: make .venv-vllm): refuses a
    busy port, waits until /v1/models lists it, prints the URL and a curl line, then runs until
    Ctrl-C or SIGTERM, which stop the server (or --detach: `verl-flow serve stop NAME` stops it)."""
    from pydantic import ValidationError

    settings = dict(locals())
    try:
        rollout = RolloutConfig(**{k: settings[k] for k in VLLM_OPTIONS})
        own = {k: settings[k] for k in ServeConfig.model_fields if k in settings}
        cfg = ServeConfig(**own, rollout=rollout)
    except ValidationError as e:
        fail(e, 2, one_line=False)
    _serve(target, cfg, store or StoreConfig().url, tracking_uri, detach=detach, replace=replace)


def _serve(
    target: str, cfg: ServeConfig, store: str, tracking_uri: str | None, *, detach: bool, replace: bool
) -> None:
    from flows.serving import Stopped, replaced, resolve_model, start, stop_on_signals

    model, handle = None, None
    with stop_on_signals():
        try:
            model = resolve_model(target, store, tracking_uri)
            log = records.record_dir(model.name) / records.LOG
            out.print(f"starting vLLM on {model.model_dir} (log {log}) ...", highlight=False, soft_wrap=True)
            handle = start(model, cfg, replace=replace, detached=detach)
            out.print(
                f"serving {target} as {', '.join(handle.names)} at {handle.url}/v1 (OpenAI-compatible); "
                f"weights sha256 {model.digest}",
                highlight=False,
                soft_wrap=True,  # one line whatever the width: logs and scripts read the URL from it
            )
            sys.stdout.write(curl_example(handle) + "\n")
            sys.stdout.flush()
            if detach:
                out.print(
                    f"detached: pid {handle.pgid} (its process group); `verl-flow serve stop {model.name}`",
                    highlight=False,
                    soft_wrap=True,
                )
                return
            code = handle.wait()
        except (KeyboardInterrupt, Stopped):
            if model is not None and handle is not None:
                handle.stop()
                records.remove_record(model.name, handle.pgid)
            elif model is not None:  # the signal came between the record's write and `handle = ...`
                for record, _ in records.read_records(model.name):
                    if record.owner_pid == os.getpid():
                        records.stop_record(record)
            out.print("stopped")
            return
        except ConfigError as e:
            fail(e, 2)
        except VerlFlowError as e:
            fail(e, 1, one_line=False)
    if replaced(model, handle):
        out.print(f"stopped (`verl-flow serve stop {model.name}` or a replacement; exit code {code})")
        return
    records.remove_record(model.name, handle.pgid)
    fail(
        f"the vLLM server exited with code {code}; log {handle.log_path}:\n{handle.log_tail()}",
        1,
        one_line=False,
    )


NameArg = Annotated[str | None, typer.Argument(help="Served name (default: every server started here)")]


def _rows(name: str | None) -> list[tuple[records.ServeRecord, str]]:
    """``(record, state)``; a stale record (its server gone) is removed, and reported as such."""
    rows = []
    for record, alive in records.read_records(name):
        if not alive:
            records.remove_record(record.name, record.pid)
        rows.append((record, "running" if alive else "stale (server gone): record removed"))
    return rows


@serve_app.command("status")
def status_cmd(name: NameArg = None, as_json: JsonOpt = False) -> None:
    """The servers started on this machine (records under $VERL_FLOW_SERVE_DIR, else ~/.verl-flow/serve):
    where each listens, what it serves (names, version, weights sha256), its pid (= process group)."""
    from rich.table import Table

    rows = _rows(name)
    if name is not None and not rows:
        fail(f"no server named {name!r} (verl-flow serve status lists them)", 1)
    if as_json:
        print_json([{**r.model_dump(mode="json"), "state": state} for r, state in rows])
        return
    if not rows:
        out.print("no servers")
        return
    table = Table("name", "state", "url", "served as", "version", "weights sha256", "pid", "started", "log")
    for r, state in rows:
        table.add_row(
            r.name,
            state,
            r.url,
            ", ".join(r.names),
            r.version or "-",
            r.digest[:16],
            str(r.pid),
            r.started,
            r.log,
        )
    print_table(table)


@serve_app.command("stop")
def stop_cmd(
    name: NameArg = None,
    every: Annotated[bool, typer.Option("--all", help="Stop every server started here")] = False,
    timeout_s: Annotated[float, typer.Option(help="Seconds after SIGTERM before SIGKILL")] = 30.0,
) -> None:
    """Stop a server (SIGTERM to its process group, SIGKILL after --timeout-s) and remove its record."""
    rows = _rows(name)
    if name is not None and not rows:
        fail(f"no server named {name!r} (verl-flow serve status lists them)", 1)
    running = [r for r, state in rows if state == "running"]
    if name is None and len(running) > 1 and not every:
        fail(f"{len(running)} servers ({', '.join(r.name for r in running)}): name one, or --all", 2)
    for r, state in rows:
        if state == "running":
            records.stop_record(r, timeout_s)
            out.print(f"stopped {r.name} (pid {r.pid}, {r.url})", highlight=False, soft_wrap=True)
        else:
            out.print(f"{r.name}: {state} (pid {r.pid})", highlight=False)
    if not rows:
        out.print("no servers")
