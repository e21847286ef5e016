"""``verl-flow models``, ``promote`` and ``rollback``: the registered models of the MLflow registry and
which version is the champion (:mod:`stages.floor.registry`).

The registry is the one the runs track to: ``--tracking-uri``; else ``$MLFLOW_TRACKING_URI``; else
the SQLite database at the root of the artifact store (``--store``, default ./runs), as
:func:`verl_core.runtime.tracking.default_tracking_uri` resolves it for a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from flows.cli.common import JsonOpt, StoreOpt, fail, out, print_json, print_table
from verl_core.config import StoreConfig
from verl_core.errors import VerlFlowError

if TYPE_CHECKING:
    from stages.floor.registry import ModelVersionRef

NameArg = Annotated[str, typer.Argument(help="Registered model name (see `verl-flow models`)")]
TrackingOpt = Annotated[
    str | None,
    typer.Option(
        "--tracking-uri",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the store's mlflow.db)",
    ),
]


def tracking_uri(tracking: str | None, store: str | None) -> str:
    """The registry's URI as a run of the store at ``store`` tracks to; a SQLite file that does not
    exist is one line (MLflow would create an empty database)."""
    from verl_core.runtime.tracking import default_tracking_uri

    uri = tracking or default_tracking_uri(store or StoreConfig().url, create=False)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        where = uri[len("sqlite:///") :]
        fail(f"no MLflow database at {where} (no run tracked there; see --store, --tracking-uri)", 1)
    return uri


def _row(ref: ModelVersionRef) -> dict[str, str]:
    d = ref.decision
    return {
        "name": ref.name,
        "version": ref.version,
        "aliases": ",".join(ref.aliases),
        "run_id": ref.tags.get("verl_flow.run_id", ""),
        "iteration": ref.tags.get("verl_flow.iteration", ""),
        "mlflow_run_id": ref.mlflow_run_id or "",
        "verdict": d.get("verdict", ""),
        "by": d.get("by", ""),
        "p_value": d.get("p_value", ""),
        "decided": d.get("time", ""),
        "reason": d.get("reason", ""),
    }


def models_cmd(
    name: Annotated[
        str | None, typer.Argument(help="Registered model (default: every verl-flow model)")
    ] = None,
    tracking: TrackingOpt = None,
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Versions of the registered models: aliases (champion, previous-champion), the verl-flow run and
    iteration each was exported from, and the last decision about it (verdict, by, p-value, reason)."""
    from verl_core.runtime.env import set_quiet_env

    set_quiet_env()
    from stages.floor import registry

    uri = tracking_uri(tracking, store)
    try:
        names = [name] if name else registry.model_names(uri)
        rows = [_row(ref) for n in names for ref in registry.versions(uri, n)]
    except VerlFlowError as e:
        fail(e, 1)
    if name and not rows:
        fail(f"no registered model {name!r} (or it has no versions) in {uri}", 1)
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print(f"no verl-flow registered models in {uri}", soft_wrap=True, highlight=False)
        return
    table = Table(*(k for k in rows[0] if k != "mlflow_run_id"), "mlflow_run")
    for r in rows:
        table.add_row(*(v for k, v in r.items() if k != "mlflow_run_id"), r["mlflow_run_id"][:12])
    print_table(table)


def promote_cmd(
    name: NameArg,
    version: Annotated[str, typer.Argument(help="Version to make the champion")],
    reason: Annotated[
        str, typer.Option("--reason", help="Why, recorded with the decision")
    ] = "promoted by hand",
    tracking: TrackingOpt = None,
    store: StoreOpt = None,
) -> None:
    """Make VERSION of NAME the champion by hand (the old champion becomes previous-champion); recorded
    as a decision by=hand and announced with the verl-flow.model.promoted event."""
    from verl_core.runtime.env import set_quiet_env

    set_quiet_env()
    from stages.floor import registry

    uri = tracking_uri(tracking, store)
    try:
        old = registry.champion(uri, name)
        registry.promote(uri, name, version, decision={"verdict": "pass", "reason": reason}, by="hand")
    except VerlFlowError as e:
        fail(e, 1)
    was = f" (was version {old.version})" if old is not None and old.version != version else ""
    out.print(f"{name} version {version} is the champion{was}", highlight=False, soft_wrap=True)


def rollback_cmd(name: NameArg, tracking: TrackingOpt = None, store: StoreOpt = None) -> None:
    """Move NAME's champion back to its previous-champion; recorded as a decision by=rollback and
    announced with the verl-flow.model.promoted event (serving follows)."""
    from verl_core.runtime.env import set_quiet_env

    set_quiet_env()
    from stages.floor import registry

    uri = tracking_uri(tracking, store)
    try:
        old = registry.champion(uri, name)
        ref = registry.rollback(uri, name)
    except VerlFlowError as e:
        fail(e, 1)
    was = old.version if old is not None else "?"
    out.print(
        f"{name} rolled back: version {ref.version} is the champion (was version {was})", highlight=False
    )
