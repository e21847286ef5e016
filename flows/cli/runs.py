"""``verl-flow runs list`` and ``runs show``: the runs of a store, a run's stages and artifacts, its
plots, rescores and family (forks and replays)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from flows.cli.common import JsonOpt, StoreOpt, fail, open_store, out, print_json, print_table
from stages.floor.locations import REPORT
from stages.floor.parent import FamilyTree, RunLink, family_tree, read_family
from stages.floor.rescore import RescoreListing, is_rescore, list_rescores
from verl_core.errors import VerlFlowError
from verl_core.store import ArtifactStore

runs_app = typer.Typer(help="Inspect runs in an artifact store.", no_args_is_help=True)


@runs_app.command("list")
def runs_list(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """List the runs in the store: id, experiment, created, updated, stages committed."""
    st = open_store(store)
    rows = []
    try:
        for run_id in st.list_runs():
            rec = st.read_run_record(run_id)
            rows.append(
                {
                    "run_id": run_id,
                    "experiment": rec.config.get("trainer", {}).get("experiment_name", ""),
                    "created_at": rec.created_at,
                    "updated_at": rec.updated_at,
                    "stages": len(st.list_manifests(run_id)),
                    "config_hash": rec.config_hash,
                }
            )
    except VerlFlowError as e:
        fail(e, 1)
    if as_json:
        print_json(rows)
        return
    table = Table("run_id", "experiment", "created", "updated", "stages", "config_hash")
    for r in rows:
        table.add_row(
            r["run_id"], r["experiment"], r["created_at"][:19], r["updated_at"][:19], str(r["stages"]),
            r["config_hash"][:12],
        )  # fmt: skip
    print_table(table)


@runs_app.command("show")
def runs_show(
    run_id: Annotated[str, typer.Argument(help="Run id")], store: StoreOpt = None, as_json: JsonOpt = False
) -> None:
    """Stages committed in RUN_ID and their artifacts with row counts and sizes."""
    st = open_store(store)
    try:
        rec = st.read_run_record(run_id)
        manifests = st.list_manifests(run_id)
    except VerlFlowError as e:
        fail(e, 1)
    report = next((m for m in manifests if m.stage == REPORT), None)
    rescores = list_rescores(manifests)
    family = family_tree(read_family(st), run_id)
    if as_json:
        stages = [
            {
                "stage": m.stage,
                "committed": m.producer.created_at,
                "manifest": st.manifest_uri(run_id, m.stage),
                "files": [
                    {
                        "name": f.name,
                        "kind": f.kind,
                        "rows": f.rows,
                        "size": f.size,
                        "uri": st.file_uri(m, f.name),
                    }
                    for f in m.files
                ],
            }
            for m in manifests
        ]
        shown: dict[str, object] = {"run_id": run_id, "store": st.url, "config_hash": rec.config_hash}
        shown |= {"code_version": rec.code_version, "stages": stages}
        if report is not None:
            shown["plots"] = [st.file_uri(report, name) for name in report.summary.get("plots", [])]
            shown["report"] = st.file_uri(report, "report.md")
        shown["rescores"] = [_rescore_entry(st, r) for r in rescores]
        shown |= _family_json(family)
        print_json(shown)
        return
    out.print(
        f"run [bold]{escape(run_id)}[/] in {st.url}  config {rec.config_hash[:12]}  code {rec.code_version}",
        soft_wrap=True,
    )
    table = Table("stage", "artifact", "kind", "rows", "size", "committed")
    for m in manifests:
        if is_rescore(m):  # listed below, one line per rescore
            continue
        for i, f in enumerate(m.files):
            table.add_row(
                m.stage if i == 0 else "",
                f.name,
                f.kind or "-",
                "-" if f.rows is None else str(f.rows),
                _human(f.size),
                m.producer.created_at[:19] if i == 0 else "",
            )
    print_table(table)
    if report is not None:
        out.print("plots:")
        for name in report.summary.get("plots", []):
            out.print(f"  {st.file_uri(report, name)}", highlight=False, soft_wrap=True)
        out.print(
            f"  per-iteration table: {st.file_uri(report, 'report.md')}", highlight=False, soft_wrap=True
        )
        _print_mlflow_location(st.url, run_id)
    _print_family(family)
    out.print(f"browse: verl-flow browse {run_id} --store {st.url}", highlight=False, soft_wrap=True)
    if rescores:
        out.print("rescores (verl-flow rescore):")
        for r in rescores:
            found = "not finished (rerun the same command to resume)"
            if r.report is not None:
                t = r.report.summary["total"]
                found = (
                    f"agreement {t['agreement']:.4f}, accuracy {t['accuracy_old']:.4f} → "
                    f"{t['accuracy_new']:.4f}, report {st.file_uri(r.report, 'report.md')}"
                )
            out.print(
                f"  {r.name}  reward config {r.reward_config_hash[:12]}  {r.stages} stages  {found}",
                highlight=False,
                soft_wrap=True,
            )


def _link_text(link: RunLink) -> str:
    if link.kind == "missing":
        return f"{link.run_id}  (not in this store)"
    if link.parent is None:
        return link.run_id
    rewards = f", rewards of rescore {link.rewards}" if link.rewards else ""
    return f"{link.run_id}  {link.kind} of {link.parent}@{link.iteration}{rewards}"


def _print_family(family: FamilyTree) -> None:
    """The family tree (parents up the chain, forks and replays down) and this run's own forks and
    replays; nothing for a run without either."""
    if not family.ancestors and not family.descendants:
        return
    out.print("family (verl-flow run --fork, verl-flow replay):")
    chain = [*reversed(family.ancestors), family.run]
    for depth, link in enumerate(chain):
        mark = "   <- this run" if link is family.run else ""
        out.print(f"  {'  ' * depth}{_link_text(link)}{mark}", highlight=False, soft_wrap=True)
    for depth, link in family.descendants:
        out.print(f"  {'  ' * (len(chain) - 1 + depth)}{_link_text(link)}", highlight=False, soft_wrap=True)
    children = [link for depth, link in family.descendants if depth == 1]
    for kind in ("replay", "fork"):
        mine = [link for link in children if link.kind == kind]
        if mine:
            out.print(f"{kind}s of this run:")
            for link in mine:
                out.print(f"  {_link_text(link)}", highlight=False, soft_wrap=True)


def _family_json(family: FamilyTree) -> dict[str, object]:
    def entry(link: RunLink) -> dict[str, object]:
        return {
            "run_id": link.run_id, "kind": link.kind, "parent": link.parent, "iteration": link.iteration,
            "rewards": link.rewards,
        }  # fmt: skip

    children = [link for depth, link in family.descendants if depth == 1]
    me = family.run
    parent = None
    if me.parent is not None:
        parent = {"run_id": me.parent, "iteration": me.iteration, "kind": me.kind, "rewards": me.rewards}
    return {
        "parent": parent,
        "ancestors": [entry(a) for a in family.ancestors],
        "descendants": [{**entry(d), "depth": depth} for depth, d in family.descendants],
        "replays": [entry(c) for c in children if c.kind == "replay"],
        "forks": [entry(c) for c in children if c.kind == "fork"],
    }


def _rescore_entry(st: ArtifactStore, r: RescoreListing) -> dict[str, object]:
    entry: dict[str, object] = {
        "name": r.name,
        "reward_config_hash": r.reward_config_hash,
        "stages": r.stages,
    }
    entry["report"] = st.file_uri(r.report, "report.md") if r.report is not None else None
    if r.report is not None:
        total = r.report.summary["total"]
        entry |= {k: total[k] for k in ("rows", "agreement", "accuracy_old", "accuracy_new")}
    return entry


def _print_mlflow_location(store_url: str, run_id: str) -> None:
    from flows.runs import attach_run

    ctx, _ = attach_run(store_url, run_id)
    if ctx.mlflow_run_id:
        out.print(
            f"  MLflow: artifacts plots/ of run {ctx.mlflow_run_id} "
            f"(mlflow ui --backend-store-uri {ctx.tracking_uri})",
            highlight=False,
            soft_wrap=True,
        )


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
