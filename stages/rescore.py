"""Rescore stages: a run's stored rollouts scored again with other reward settings (``verl-flow
rescore``), and the comparison of the new rewards with the stored ones.

:func:`rescore` writes, for every stage of the plan (:class:`~stages.floor.rescore.RescorePlan`), the
stage ``rescore/{name}/{stage}`` with the same rewards file names as the original::

    rescore/{name}/iter-XXXX/reward[/gen-K]   rewards.parquet          training rollouts
    rescore/{name}/iter-XXXX/val              rewards.parquet, sampled/rewards.parquet
    rescore/{name}/eval/{label}               greedy/rewards.parquet, sampled/rewards.parquet

each keyed by the reward settings (``params``) and the rollout and original reward manifests
(``inputs``), its summary naming the reward config hash; a committed one is skipped, so a killed
rescore resumes where it stopped. The scorers are built once for the whole rescore (a remote or
judge scorer's concurrency and retries work across each table). The run's own stages are only read.

:func:`rescore_report` compares old and new rewards (:mod:`verl_core.reward.compare`; ReMax's greedy
baseline rows are left out, as the reward stage's metrics leave them out) into ``rescore/{name}/report``::

    comparison.parquet     kind "reward_comparison": per table, old vs new mean score and accuracy,
                           agreement of the correct flags and their confusion
    disagreements.parquet  kind "reward_disagreements": the DISAGREEMENTS_PER_TABLE samples of each
                           table where old and new disagree most
    report.md              those tables, the totals, and the scoring time vs the run's own
    plots/accuracy.png     old vs new accuracy per iteration (training, validation)
    report.json            the summary (:class:`~stages.floor.rescore.RescoreReport`)

and logs them, with per-iteration metrics ``rescore/{split}/...``, to an MLflow run nested under the
run's (tag ``mlflow.parentRunId``).
"""

from __future__ import annotations

import io
import time
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from prefect import task

from stages.floor.locations import rescore_report_stage, rescore_stage
from stages.floor.logging import stage_logger
from stages.floor.rescore import ComparisonRow, RescorePlan, RescoreReport, RescoreTarget, reward_params
from stages.floor.retry import retry_unless_deterministic
from stages.floor.scorers import build_scorers, score_batch
from verl_core.config import RewardConfig, SandboxConfig
from verl_core.errors import DataError
from verl_core.reward import WeightedScorer, batch_from_columns, rewards_table
from verl_core.reward.compare import RewardComparison, combine_comparisons, compare_rewards, most_disagreeing
from verl_core.runtime.run import RunContext
from verl_core.runtime.tracking import MlflowTracker, NullTracker, Tracker, log_bytes
from verl_core.store import ArtifactStore, Manifest
from verl_core.store.schemas import get_schema

DISAGREEMENTS_PER_TABLE = 5
MARKDOWN_SAMPLES = 10  # disagreements shown in report.md (all of them are in disagreements.parquet)
_ROLLOUT_COLUMNS = ["data_source", "prompt_text", "response_text", "ground_truth", "is_baseline"]


@task(name="rescore", retry_condition_fn=retry_unless_deterministic)
def rescore(
    ctx: RunContext, cfg: RewardConfig, sandbox: SandboxConfig, plan: RescorePlan, max_response_length: int
) -> list[str]:
    """Score every stage of ``plan`` with ``cfg`` (the run's ``max_response_length``: the overlong
    penalty's); returns the rescored stages' manifest URIs, in plan order."""
    log = stage_logger(__name__)
    store = ctx.store()
    params = {**reward_params(cfg, sandbox), "max_response_length": max_response_length}
    scorers: list[WeightedScorer] | None = None
    uris, skipped = [], 0
    for target in plan.targets:
        # 1. Skip when committed with the same settings and inputs
        inputs = {"rollout": target.rollout_uri, "rewards": target.rewards_uri}
        where = rescore_stage(plan.name, target.stage)
        stage = store.open_stage(ctx.run_id, where, params=params, inputs=inputs)
        if stage.done:
            uris.append(stage.manifest_uri)
            skipped += 1
            continue
        # 2. Score each table with the scorers built once, write, commit
        scorers = scorers if scorers is not None else build_scorers(cfg, sandbox)
        rollouts_manifest = store.read_manifest(target.rollout_uri)
        t0, rows = time.perf_counter(), 0
        for rollouts_file, rewards_file in target.tables:
            batch = batch_from_columns(store.read_table(rollouts_manifest, rollouts_file))
            result = score_batch(cfg, sandbox, batch, max_response_length, scorers)
            stage.write_table(rewards_file, rewards_table(batch, result), "rewards")
            rows += batch.size
        seconds = time.perf_counter() - t0
        summary = {
            "name": plan.name, "reward_config_hash": plan.reward_config_hash, "source": target.stage,
            "split": target.split, "iteration": target.iteration, "rows": rows, "seconds": seconds,
        }  # fmt: skip
        uris.append(stage.commit(summary=summary))
        log.info("rescore %s: %s, %d rows in %.2f s", plan.name, target.stage, rows, seconds)
    log.info("rescore %s: %d stages scored, %d already committed", plan.name, len(uris) - skipped, skipped)
    return uris


@task(name="rescore-report")
def rescore_report(ctx: RunContext, plan: RescorePlan, unit_uris: list[str]) -> str:
    """Compare the rescored stages ``unit_uris`` (in ``plan`` order) with the stored rewards; returns
    the report stage's manifest URI."""
    store = ctx.store()
    # 1. Skip when committed for these rescored stages
    params = {"reward_config_hash": plan.reward_config_hash, "overrides": list(plan.overrides)}
    inputs = {t.stage: uri for t, uri in zip(plan.targets, unit_uris, strict=True)}
    stage = store.open_stage(ctx.run_id, rescore_report_stage(plan.name), params=params, inputs=inputs)
    if stage.done:
        return stage.manifest_uri

    # 2. Compare every rescored table with the stored one
    parts: list[tuple[ComparisonRow, RewardComparison]] = []
    samples: list[dict[str, Any]] = []
    scoring_s = train_scoring_s = original_s = 0.0
    for target, uri in zip(plan.targets, unit_uris, strict=True):
        unit, old = store.read_manifest(uri), store.read_manifest(target.rewards_uri)
        rollouts = store.read_manifest(target.rollout_uri)
        scoring_s += float(unit.summary.get("seconds", 0.0))
        if target.split == "train":  # vs what the run spent producing these rewards in the first place
            train_scoring_s += float(unit.summary.get("seconds", 0.0))
            original_s += float(rollouts.summary.get("seconds", 0.0)) + float(old.summary.get("seconds", 0.0))
        for rollouts_file, rewards_file in target.tables:
            row, comparison, top = _compare_table(
                store, target, rollouts, old, unit, rollouts_file, rewards_file
            )
            if row.rows:
                parts.append((row, comparison))
                samples += top
    total = ComparisonRow.of("all", "all", -1, combine_comparisons([c for _, c in parts]))

    # 3. Write the tables, the plot, the markdown; log to the MLflow child run; commit
    plot = _accuracy_png(_per_iteration(parts))
    report = RescoreReport(
        name=plan.name, reward_config_hash=plan.reward_config_hash, overrides=list(plan.overrides),
        parts=[r for r, _ in parts], total=total, plots=["plots/accuracy.png"],
        scoring_s=scoring_s, train_scoring_s=train_scoring_s, original_s=original_s,
    )  # fmt: skip
    markdown = _markdown(ctx.run_id, report, samples)
    comparison = pa.Table.from_pylist(
        [r.model_dump() for r in report.parts], schema=get_schema("reward_comparison")
    )
    disagreements = pa.Table.from_pylist(samples, schema=get_schema("reward_disagreements"))
    stage.write_table("comparison.parquet", comparison, "reward_comparison")
    stage.write_table("disagreements.parquet", disagreements, "reward_disagreements")
    stage.write_bytes("report.md", markdown.encode())
    stage.write_bytes("plots/accuracy.png", plot)
    stage.write_json("report.json", report.model_dump(mode="json"))
    _log_child_run(ctx, plan, report, parts, {"report.md": markdown.encode(), "plots/accuracy.png": plot})
    uri = stage.commit(summary=report.model_dump(mode="json"))
    stage_logger(__name__).info(
        "rescore %s: %d rows, agreement %.4f, accuracy %.4f → %.4f (%s)",
        plan.name, total.rows, total.agreement, total.accuracy_old, total.accuracy_new, uri,
    )  # fmt: skip
    return uri


def _compare_table(
    store: ArtifactStore,
    target: RescoreTarget,
    rollouts_manifest: Manifest,
    old_manifest: Manifest,
    new_manifest: Manifest,
    rollouts_file: str,
    rewards_file: str,
) -> tuple[ComparisonRow, RewardComparison, list[dict[str, Any]]]:
    """Old vs new rewards of one table: its comparison row and its most disagreeing samples."""
    part = rewards_file.rpartition("/")[0]  # "", "sampled", "greedy"
    source = f"{target.stage}/{part}" if part else target.stage
    split = f"{target.split}/{part}" if part else target.split
    rollouts = store.read_table(rollouts_manifest, rollouts_file, columns=_ROLLOUT_COLUMNS).to_pydict()
    old = store.read_table(old_manifest, rewards_file).to_pydict()
    new = store.read_table(new_manifest, rewards_file).to_pydict()
    keys = ("group_id", "sample_index")
    if [old[k] for k in keys] != [new[k] for k in keys] or len(old["score"]) != len(rollouts["is_baseline"]):
        raise DataError(f"rescore: {source}: the stored and the new rewards are not of the same rows")
    keep = [i for i, baseline in enumerate(rollouts["is_baseline"]) if not baseline]

    def pick(column: list[Any]) -> list[Any]:
        return [column[i] for i in keep]

    rows, comparison = compare_rewards(
        pick(old["score"]), pick(new["score"]), pick(old["correct"]), pick(new["correct"])
    )
    top = []
    for j in most_disagreeing(rows, DISAGREEMENTS_PER_TABLE):
        i = keep[j]
        top.append({
            "source": source, "split": split, "iteration": target.iteration,
            "group_id": old["group_id"][i], "sample_index": old["sample_index"][i],
            **{k: rollouts[k][i] for k in ("data_source", "prompt_text", "response_text", "ground_truth")},
            "score_old": rows.score_old[j], "score_new": rows.score_new[j],
            "correct_old": rows.correct_old[j], "correct_new": rows.correct_new[j],
            "extracted_old": old["extracted_answer"][i], "extracted_new": new["extracted_answer"][i],
            "abs_diff": rows.abs_diff[j],
        })  # fmt: skip
    return ComparisonRow.of(source, split, target.iteration, comparison), comparison, top


def _per_iteration(
    parts: list[tuple[ComparisonRow, RewardComparison]],
) -> dict[str, dict[int, RewardComparison]]:
    """``{split: {iteration: comparison}}`` for training (generation batches combined) and greedy
    validation: what the plot and the per-iteration metrics show."""
    grouped: dict[str, dict[int, list[RewardComparison]]] = {"train": {}, "val": {}}
    for row, comparison in parts:
        if row.split in grouped:
            grouped[row.split].setdefault(row.iteration, []).append(comparison)
    return {s: {it: combine_comparisons(cs) for it, cs in sorted(by.items())} for s, by in grouped.items()}


def _accuracy_png(series: Mapping[str, Mapping[int, RewardComparison]]) -> bytes:
    """Old (dashed) vs new (solid) accuracy per iteration, training and validation."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    ax = fig.add_subplot()
    for split, label in (("train", "training"), ("val", "held-out (greedy)")):
        points = series.get(split, {})
        if not points:
            continue
        xs = sorted(points)
        (line,) = ax.plot(
            xs, [points[x].accuracy_new for x in xs], marker="o", markersize=3, label=f"{label}, new"
        )
        ax.plot(
            xs,
            [points[x].accuracy_old for x in xs],
            linestyle="--",
            color=line.get_color(),
            label=f"{label}, stored",
        )
    ax.set_title("accuracy: stored rewards vs rescored")
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def _cell(text: str | None, width: int = 80) -> str:
    """One markdown table cell: no newlines or pipes, at most ``width`` characters."""
    if text is None:
        return "-"
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _markdown(run_id: str, report: RescoreReport, samples: list[dict[str, Any]]) -> str:
    t = report.total
    lines = [
        f"# rescore `{report.name}` of run `{run_id}`", "",
        f"- reward config `{report.reward_config_hash[:12]}`, overrides: "
        + (", ".join(f"`{o}`" for o in report.overrides) or "none (the run's own settings)"),
        f"- {t.rows} samples: agreement {t.agreement:.4f}, accuracy {t.accuracy_old:.4f} → "
        f"{t.accuracy_new:.4f}, mean score {t.score_old_mean:.4f} → {t.score_new_mean:.4f}, "
        f"{t.scores_changed} scores changed",
        f"- correct flags (stored, new): TT {t.tt}, TF {t.tf}, FT {t.ft}, FF {t.ff}",
        f"- scoring every table took {report.scoring_s:.2f} s, the training rollouts "
        f"{report.train_scoring_s:.2f} s; the run's own rollout + reward of those iterations took "
        f"{report.original_s:.2f} s", "",
        "| source | rows | score stored → new | accuracy stored → new | agreement "
        "| TT | TF | FT | FF | changed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in report.parts:
        lines.append(
            f"| {r.source} | {r.rows} | {r.score_old_mean:.4g} → {r.score_new_mean:.4g} | "
            f"{r.accuracy_old:.4g} → {r.accuracy_new:.4g} | {r.agreement:.4g} | {r.tt} | {r.tf} | {r.ft} | "
            f"{r.ff} | {r.scores_changed} |"
        )
    top = sorted(samples, key=lambda s: (s["correct_old"] == s["correct_new"], -s["abs_diff"]))
    lines += ["", "## where they disagree most", ""]
    if not top:
        lines.append("nowhere: every score and correct flag is the same")
        return "\n".join(lines) + "\n"
    lines += [
        "| source | row | response | ground truth | answer stored → new | score stored → new "
        "| correct stored → new |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in top[:MARKDOWN_SAMPLES]:
        lines.append(
            f"| {s['source']} | {s['group_id']}/{s['sample_index']} | {_cell(s['response_text'])} | "
            f"{_cell(s['ground_truth'], 20)} | "
            f"{_cell(s['extracted_old'], 20)} → {_cell(s['extracted_new'], 20)} | "
            f"{s['score_old']:.4g} → {s['score_new']:.4g} | {s['correct_old']} → {s['correct_new']} |"
        )
    return "\n".join(lines) + "\n"


def _log_child_run(
    ctx: RunContext,
    plan: RescorePlan,
    report: RescoreReport,
    parts: list[tuple[ComparisonRow, RewardComparison]],
    files: Mapping[str, bytes],
) -> None:
    """The report in an MLflow run nested under the run's (none when the run is not tracked)."""
    tracker: Tracker = NullTracker()
    if ctx.tracking_uri and ctx.mlflow_run_id:
        key, run_name = f"rescore/{plan.name}", f"{ctx.run_id} rescore {plan.name}"
        tracker = MlflowTracker.start_child(ctx.tracking_uri, ctx.mlflow_run_id, key, run_name)
    tracker.set_tags(
        {"verl_flow.rescore": plan.name, "verl_flow.reward_config_hash": plan.reward_config_hash}
    )
    tracker.log_dict(report.model_dump(mode="json"), "rescore/report.json")
    for split, by_iteration in _per_iteration(parts).items():
        for it, c in by_iteration.items():
            metrics = {
                "accuracy_old": c.accuracy_old, "accuracy_new": c.accuracy_new, "agreement": c.agreement,
                "score_old_mean": c.score_old_mean, "score_new_mean": c.score_new_mean,
            }  # fmt: skip
            tracker.log_metrics({f"rescore/{split}/{k}": v for k, v in metrics.items()}, step=it)
    tracker.log_table(
        {k: [getattr(r, k) for r in report.parts] for k in ComparisonRow.model_fields},
        "rescore/comparison.json",
    )
    for name, data in files.items():
        log_bytes(tracker, data, f"rescore/{name}")
    tracker.end("FINISHED")
