"""``verl-flow doctor [--config CONFIG] [OVERRIDES...]``: versions, pins and reachability, as a table.

The checks are :func:`stages.floor.environment.doctor_checks` (plain functions returning
:class:`verl_core.runtime.doctor.Check` rows); this module only formats them. Exit 0 when nothing is an
error (warnings do not fail), 1 with each problem and its fix on one line of stderr, 2 for a bad config.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from verl_core.runtime.doctor import Check, known_bad_checks, problems

_STYLE = {"ok": "green", "warn": "yellow", "error": "bold red"}


def doctor(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="Dotted overrides, e.g. rollout.name=vllm (on the defaults without --config)"),
    ] = None,
    config: Annotated[
        str | None, typer.Option("--config", "-c", help="YAML config whose needs are checked too")
    ] = None,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds each reachability check (store, MLflow) may take")
    ] = 5.0,
) -> None:
    """Check versions and pins, the torch build, and (with a config) its needs, store and MLflow.

    Installed packages against the project's declared ranges and the pins installed packages declare
    (vLLM's torch and transformers ...); with --config or overrides also what that config needs (vLLM,
    DeepSpeed, bitsandbytes, CUDA) and whether its artifact store and MLflow answer."""
    from stages.floor.environment import doctor_checks
    from verl_core.config import load_config
    from verl_core.errors import ConfigError

    err = Console(stderr=True)
    try:
        cfg = load_config(config, overrides or []) if config or overrides else None
    except ConfigError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    checks = doctor_checks(cfg, timeout_s=timeout) + known_bad_checks()
    print_checks(checks, title=f"verl-flow doctor{f' --config {config}' if config else ''}")
    errors = problems(checks)
    for c in errors:
        err.print(f"[bold red]error:[/] {escape(c.line())}", highlight=False, soft_wrap=True)
    if errors:
        raise typer.Exit(1)


def print_checks(checks: list[Check], *, title: str) -> None:
    """One row per check; on a terminal rich fits the table to its width, elsewhere (a pipe, a file,
    CI logs) every value is printed whole."""
    out = Console() if sys.stdout.isatty() else Console(width=100_000)
    table = Table("check", "status", "found", "expected", "fix", title=title, title_justify="left")
    for c in checks:
        status = f"[{_STYLE[c.status]}]{c.status}[/]"
        table.add_row(escape(c.name), status, escape(c.found), escape(c.expected), escape(c.fix))
    out.print(table, highlight=False)
    counts = {s: sum(c.status == s for c in checks) for s in _STYLE}
    out.print(f"{counts['ok']} ok, {counts['warn']} warnings, {counts['error']} errors", highlight=False)
