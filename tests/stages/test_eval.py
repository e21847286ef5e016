"""Eval stage: greedy accuracy and sampled pass@k of an export / a checkpoint / an exported directory,
reported per data source and consistent with the committed sample tables."""

from __future__ import annotations

import json
from pathlib import Path

from stages.eval import evaluate
from stages.export import export_model
from stages.floor.artifacts import copy_export, dir_source, export_source, in_run_source
from stages.floor.locations import template_pack_uri
from stages.floor.reports import EvalReport, SourceReport, eval_samples, read_eval_report
from tests.stages.test_export import _checkpoint, _run
from verl_core.algorithms.evaluation import pass_at_k
from verl_core.store import ArtifactStore, Manifest


def test_eval_reports_accuracy_and_pass_at_k(tmp_path: Path) -> None:
    # a store whose own path contains "/runs/" (the eval stage is named from the manifest, not the URI)
    ctx, cfg = _run(tmp_path / "runs" / "store", "ev", 0)
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"k": 3, "max_samples": 6})})
    _checkpoint(ctx, cfg, 1)
    store = ctx.store()
    tp = template_pack_uri(store, ctx.run_id)
    export_uri = export_model.fn(ctx, cfg, tp, 1)

    uri = evaluate.fn(ctx, cfg, tp, export_source(ctx.store(), export_uri))
    m = store.read_manifest(uri)
    assert m.stage == "eval/export-iter-0001"
    report = m.summary
    greedy = store.read_table(m, "greedy/rewards.parquet")
    sampled = store.read_table(m, "sampled/rewards.parquet")
    assert report["prompts"] == greedy.num_rows == 6 and sampled.num_rows == 6 * 3
    # accuracy = mean greedy correctness; pass@3 with n = k = 3 is "any of the 3 correct"
    assert report["accuracy"] == sum(greedy.column("correct").to_pylist()) / 6
    correct = sampled.column("correct").to_pylist()
    groups = sampled.column("group_id").to_pylist()
    any_ok = [any(c for c, g in zip(correct, groups, strict=True) if g == p) for p in range(6)]
    assert report["pass@3"] == sum(any_ok) / 6
    assert (
        report["pass@1"]
        == sum(correct) / 18
        == sum(
            pass_at_k(3, sum(c for c, g in zip(correct, groups, strict=True) if g == p), 1) for p in range(6)
        )
        / 6
    )
    assert set(report["by_source"]) == {"synthetic/arithmetic"}
    assert report["by_source"]["synthetic/arithmetic"]["prompts"] == 6
    # the typed report flows read is the committed summary, and back
    typed = read_eval_report(store, uri)
    assert typed == EvalReport(
        source="export-iter-0001",
        prompts=6,
        accuracy=report["accuracy"],
        k=3,
        pass_at_1=report["pass@1"],
        pass_at_k=report["pass@3"],
        by_source={
            "synthetic/arithmetic": SourceReport(
                prompts=6, accuracy=report["accuracy"], pass_at_k=report["pass@3"]
            )
        },
    )
    assert typed.summary() == report == json.loads(store.read_bytes(m, "report.json"))
    rows = eval_samples(store, uri, 4)
    assert len(rows) == 4
    assert [r.response for r in rows] == greedy_texts(store, m)[:4]
    assert [r.correct for r in rows] == greedy.column("correct").to_pylist()[:4]

    # the same policy as an in-run checkpoint and as a copied directory: same greedy answers
    ckpt = store.read_manifest(evaluate.fn(ctx, cfg, tp, in_run_source(store, ctx.run_id, 1)))
    assert ckpt.stage == "eval/ckpt-iter-0001"
    out = copy_export(store, store.read_manifest(export_uri), str(tmp_path / "model"))
    d = store.read_manifest(evaluate.fn(ctx, cfg, tp, dir_source(out)))
    texts = [greedy_texts(store, x) for x in (m, ckpt, d)]
    assert texts[0] == texts[1] == texts[2]
    # rerun: skipped
    assert (
        evaluate.fn(ctx, cfg, tp, export_source(ctx.store(), export_uri)) == uri
        and store.read_manifest(uri).attempt == m.attempt
    )


def greedy_texts(store: ArtifactStore, m: Manifest) -> list[str]:
    return store.read_table(m, "greedy/rollouts.parquet").column("response_text").to_pylist()
