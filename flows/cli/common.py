"""What every command shares: the consoles, the argument types, one-line failures, tables and JSON."""

from __future__ import annotations

import json
import sys
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from verl_core.config import StoreConfig, VerlFlowConfig, load_config
from verl_core.errors import ConfigError
from verl_core.store import ArtifactStore

out = Console()
err = Console(stderr=True)

ConfigArg = Annotated[str, typer.Argument(help="YAML config file (e.g. configs/quickstart.yaml)")]
OverridesArg = Annotated[
    list[str] | None, typer.Argument(help="Dotted overrides, e.g. actor.lr=1e-6 rollout.n=8")
]
StoreOpt = Annotated[
    str | None,
    typer.Option("--store", help="Artifact store URL (default: the config default, ./runs)"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")]
RunIdArg = Annotated[str, typer.Argument(help="Run id")]


def fail(exc: Exception | str, code: int, *, one_line: bool = True) -> NoReturn:
    """Print the error and exit with ``code``: one line, or (``one_line=False``) one line per line of
    the message, each its own problem (a config can have several, see verl_core.config.preflight)."""
    text = str(exc)
    lines = [" ".join(text.split("\n"))] if one_line else text.splitlines()
    for line in lines:
        err.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def load(config: str, overrides: list[str] | None) -> VerlFlowConfig:
    """``config`` with ``overrides``, validated; a bad one exits 2 with one line per problem."""
    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        fail(e, 2, one_line=False)


def print_table(table: Table) -> None:
    """On a terminal, fitted to its width; piped (a file, a CI log), at the table's natural width so
    that no value is cut or ellipsized."""
    if out.is_terminal:
        out.print(table)
    else:
        Console(width=1 << 20, highlight=False).print(table)


def print_json(obj: object) -> None:
    """``obj`` as indented JSON on stdout (the commands' ``--json``)."""
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def open_store(url: str | None) -> ArtifactStore:
    """The artifact store at ``url`` (None: the config default, ./runs)."""
    return ArtifactStore(url or StoreConfig().url)
