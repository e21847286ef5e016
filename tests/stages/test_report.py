"""Report stage: per-iteration series from hand-written manifests (which figures come from which
stage, how an iteration's seconds add up), the markdown table, and the plots it commits."""

from __future__ import annotations

import json
from pathlib import Path

from stages.floor.locations import iteration_stage
from stages.floor.reports import collect_series, metrics_markdown
from stages.report import report
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore


def _commit(store: ArtifactStore, stage: str, summary: dict[str, object]) -> None:
    store.open_stage("r", stage).commit(summary=summary)


def _run(tmp_path: Path) -> ArtifactStore:
    store = ArtifactStore(str(tmp_path))
    _commit(store, iteration_stage(0, "rollout"), {"samples": 8, "seconds": 2.0})
    # the reward's batch figures (critic/, response_length/) are left to the update, which reports them too
    _commit(
        store,
        iteration_stage(0, "reward"),
        {"metrics": {"critic/score/mean": 9.0, "reward/accuracy": 0.25, "response_length/mean": 99.0}},
    )
    _commit(
        store,
        iteration_stage(0, "update"),
        {"critic/score/mean": 0.5, "actor/entropy": 1.5, "timing_s/update_actor": 3.0, "iteration": 0},
    )
    _commit(
        store,
        iteration_stage(1, "val"),
        {"accuracy": 0.75, "val/accuracy": 0.75, "timing_s/validate_generate": 7.0},
    )
    _commit(store, "ckpt/iter-0001", {"iteration": 1, "actor/entropy": 5.0})  # not an iteration stage
    return store


def test_series_come_from_the_iteration_stages(tmp_path: Path) -> None:
    series = collect_series(_run(tmp_path), "r")
    assert series["critic/score/mean"] == {0: 0.5}  # from the update, not the reward's 9.0
    assert series["reward/accuracy"] == {0: 0.25}
    assert "response_length/mean" not in series
    assert series["actor/entropy"] == {0: 1.5}  # the checkpoint's 5.0 is not read
    assert series["val/accuracy"] == {1: 0.75}
    assert "accuracy" not in series  # only namespaced figures (with a '/') are series
    assert series["timing_s/rollout"] == {0: 2.0}
    # iteration 0's seconds: rollout 2.0 + update 3.0; validation time is not part of an iteration
    assert series["iteration_s"] == {0: 5.0}


def test_metrics_table(tmp_path: Path) -> None:
    table = metrics_markdown(collect_series(_run(tmp_path), "r"))
    assert table.splitlines() == [
        "| iteration | reward | train acc | val acc | entropy | seconds |",
        "|---:|---:|---:|---:|---:|---:|",
        "| 0 | 0.5 | 0.25 |  | 1.5 | 5 |",
        "| 1 |  |  | 0.75 |  |  |",
    ]


def test_report_commits_plots_and_table(tmp_path: Path) -> None:
    store = _run(tmp_path)
    ctx = RunContext(run_id="r", store_url=str(tmp_path))
    uri = report.fn(ctx, {"preprocess": 1.0, "rl": 4.0}, {"rollout": 2.5, "update": 1.5})
    m = store.read_manifest(uri)
    assert m.stage == "report"
    assert m.summary["plots"] == [
        "plots/entropy.png",
        "plots/kl.png",
        "plots/response_length.png",
        "plots/reward_accuracy.png",
        "plots/timing.png",
    ]
    assert all(store.read_bytes(m, p).startswith(b"\x89PNG") for p in m.summary["plots"])
    assert "| 0 | 0.5 | 0.25 |" in store.read_bytes(m, "report.md").decode()
    metrics = json.loads(store.read_bytes(m, "metrics.json"))
    assert metrics["stage_seconds"] == {"preprocess": 1.0, "rl": 4.0}
    assert metrics["rl_phase_seconds"] == {"rollout": 2.5, "update": 1.5}
