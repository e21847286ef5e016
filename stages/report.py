"""Report stage: training curves of a run as PNG plots and a markdown summary.

Reads the committed per-iteration manifests (``iter-XXXX/{rollout,reward,update,val}``: their
summaries hold the iteration's metrics) and the pipeline's per-stage wall times; writes under the
stage ``report``::

    plots/reward_accuracy.png   train reward mean, train accuracy, held-out accuracy per iteration
    plots/kl.png                PPO KL (actor/ppo_kl), KL loss / KL-in-reward penalty when used
    plots/entropy.png           policy entropy
    plots/response_length.png   mean response length (train and held-out)
    plots/timing.png            seconds per pipeline stage, and per RL phase per iteration
    metrics.json                the series behind the plots, the stage and RL phase seconds
    report.md                   per-iteration metrics table (:func:`stages.floor.reports.metrics_markdown`)

and logs the PNGs and the markdown to the run's MLflow run under ``plots/``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

from prefect import task

from stages.floor.locations import REPORT
from stages.floor.logging import stage_logger
from stages.floor.reports import collect_series, metrics_markdown
from verl_core.runtime.run import RunContext
from verl_core.runtime.tracking import log_bytes

STAGE = REPORT

# plot file → [(series name, label)]; a series missing from the run is left out of its plot
PLOTS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "reward_accuracy": (
        "reward and accuracy",
        [
            ("critic/score/mean", "train reward (mean score)"),
            ("reward/accuracy", "train accuracy"),
            ("val/accuracy", "held-out accuracy (greedy)"),
        ],
    ),
    "kl": (
        "KL",
        [
            ("actor/ppo_kl", "actor/ppo_kl (old → new policy)"),
            ("actor/kl_loss", "actor/kl_loss (to reference)"),
            ("actor/reward_kl_penalty", "KL penalty in the reward"),
        ],
    ),
    "entropy": ("policy entropy", [("actor/entropy", "actor/entropy")]),
    "response_length": (
        "response length (tokens)",
        [("response_length/mean", "train"), ("val/response_length", "held-out")],
    ),
}


def _png(title: str, lines: list[tuple[str, dict[int, float]]], xlabel: str = "iteration") -> bytes:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    ax = fig.add_subplot()
    for label, points in lines:
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", markersize=3, label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def _timing_png(stage_seconds: Mapping[str, float], series: Mapping[str, Mapping[int, float]]) -> bytes:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.0), dpi=100)
    left, right = fig.subplots(1, 2)
    names = list(stage_seconds)
    left.barh(names, [stage_seconds[k] for k in names])
    left.set_title("seconds per pipeline stage")
    left.invert_yaxis()
    for key, values in sorted(series.items()):
        if key.startswith("timing_s/") and values:
            xs = sorted(values)
            right.plot(xs, [values[x] for x in xs], label=key.removeprefix("timing_s/"))
    right.set_title("seconds per RL phase")
    right.set_xlabel("iteration")
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


@task(name="report")
def report(
    ctx: RunContext, stage_seconds: dict[str, float], rl_phase_seconds: dict[str, float] | None = None
) -> str:
    """Render the run's plots and metrics table from its committed iteration stages, the pipeline's
    ``stage_seconds`` (stage → wall seconds) and ``rl_phase_seconds`` (RL phase → seconds inside the
    loop, kept in metrics.json); returns the report stage's manifest URI."""
    store = ctx.store()
    series = collect_series(store, ctx.run_id)
    plots = {
        name: _png(title, [(label, series[key]) for key, label in lines if series.get(key)])
        for name, (title, lines) in PLOTS.items()
    }
    plots["timing"] = _timing_png(stage_seconds, series)
    markdown = f"# run {ctx.run_id}\n\n## per-iteration metrics\n\n{metrics_markdown(series)}\n"
    # the report is cheap and depends on wall times: rewritten on every pipeline run
    stage = store.open_stage(ctx.run_id, STAGE, force=True)
    for name, data in plots.items():
        stage.write_bytes(f"plots/{name}.png", data)
    stage.write_json(
        "metrics.json",
        {"series": series, "stage_seconds": stage_seconds, "rl_phase_seconds": rl_phase_seconds or {}},
    )
    stage.write_bytes("report.md", markdown.encode())
    uri = stage.commit(summary={"plots": sorted(f"plots/{n}.png" for n in plots)})
    tracker = ctx.tracker()
    for name, data in plots.items():
        log_bytes(tracker, data, f"plots/{name}.png")
    tracker.log_text(markdown, "plots/report.md")
    stage_logger(__name__).info("report: %d plots in %s", len(plots), uri)
    return uri
