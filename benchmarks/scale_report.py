"""The tables of ``benchmarks/scale.py``'s records (Markdown, pasted into ``benchmarks/RESULTS.md``), and
the cost model (:mod:`verl_core.planning.cost`) fitted on the smaller sizes and checked on the others."""

from __future__ import annotations

from dataclasses import asdict
from statistics import median
from typing import Any

from verl_core.planning.cost import (
    CPU_BANDWIDTH,
    PHASES,
    Calibration,
    Workload,
    fit_calibration,
    phase_features,
    predict,
)
from verl_core.planning.geometry import Geometry
from verl_core.planning.rates import ShapeRates

GIB = 1024**3
# price FLOPs at the records' own shape rates and the checkpoint at their write bandwidth where they
# carry them; False: one matmul rate and a per-byte checkpoint, the form `verl-flow plan` predicts with
# (CPU_CALIBRATION). On the quiet 29 Nov records the shaped form predicts 0.5B no better (forwards
# 1.06-1.15 against 1.03-1.14) and its save further off (1.9-2.1 against 1.4-2.1): benchmarks/RESULTS.md
SHAPES = False
# the fit's relative error turns absolute below this many seconds (fit_calibration's floor_s); 0: plain
# relative error, as CPU_CALIBRATION was fitted (0.2 s was tried: benchmarks/RESULTS.md, issue 37)
FIT_FLOOR_S = 0.0
TABLE_PHASES = (
    "generation", "reward", "old_log_prob", "ref", "values", "adv", "update_actor", "update_critic",
    "weight_sync",
)  # fmt: skip
FLOP_PHASES = {
    "generation": "gen_flop",
    "old_log_prob": "matmul_flop",
    "ref": "matmul_flop",
    "values": "matmul_flop",
    "update_actor": "matmul_flop",
    "update_critic": "matmul_flop",
}


def measured(r: dict[str, Any]) -> dict[str, float]:
    """Seconds per cost-model phase of a record's last iteration (checkpoint phases: per checkpoint)."""
    last = r["iterations"][-1]
    out = {p: s for p, s in last["phases"].items() if p in PHASES}
    out["orchestration"] = last["orchestration_s"]
    out["checkpoint_save"] = r["checkpoint_save_s"]
    out["checkpoint_load"] = r["checkpoint_load_s"]
    return out


def best_rate(r: dict[str, Any]) -> float:
    """The run's matmul rate: the highest of its measurements (before, before each iteration, after).
    On a shared machine a 1-s measurement catches whatever else runs at that moment; the highest is the
    closest to the machine the phases had between them."""
    return max([r["rate_flops"], *r.get("rate_before_after", []), *r.get("rates_during", [])])


def best_bandwidth(r: dict[str, Any]) -> float:
    """The run's copy bandwidth, the highest of its measurements (as :func:`best_rate`); records
    written before the benchmark measured one: the calibration machine's."""
    return max(r.get("bandwidths", []), default=CPU_BANDWIDTH)


def features(
    r: dict[str, Any], rate: float | None = None, bandwidth: float | None = None, shaped: bool = True
) -> dict[str, dict[str, float]]:
    """The cost model's features of a record; ``shaped``: at its shape rates and write bandwidth
    where it has them (:data:`SHAPES`)."""
    # records written before Workload had n / share_prompts: the benchmark's n, prompts shared (default)
    shape = {"n": r.get("workload", {}).get("n", 1), "share_prompts": True, **r["workload_model"]}
    g, w = Geometry(**r["geometry"]), Workload(**shape)
    rate = best_rate(r) if rate is None else rate
    on = SHAPES and shaped
    shapes = ShapeRates.from_json(r["shape_rates"]) if "shape_rates" in r and on else None
    write = max(r.get("write_bandwidths", []), default=None) if on else None
    bw = best_bandwidth(r) if bandwidth is None else bandwidth
    return phase_features(g, w, rate, bw, shapes, write, measured_free_at_save(r))


def measured_free_at_save(r: dict[str, Any]) -> float | None:
    """The host's free memory (``MemFree``) when the record's checkpoint save began; None for records
    written before ``benchmarks/scale.py`` read it."""
    before = r.get("checkpoint_meminfo", {}).get("before")
    return None if before is None else float(before["MemFree"])


def _s(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 10 else f"{x:.1f}"


def _key(r: dict[str, Any]) -> tuple[int, str, str]:
    return (r["n_params"], r["algo"], r.get("tag", ""))


def _label(r: dict[str, Any]) -> str:
    """The record's algorithm, with its workload tag when it has one."""
    return r["algo"] + (f" {r['tag']}" if r.get("tag") else "")


def seconds_table(records: list[dict[str, Any]]) -> None:
    print("\nSeconds per phase, last iteration (checkpoint: the final one, once per run):\n")
    head = ["size", "algo", "params", "gen vLLM", "gen HF", "gen tok/s", *TABLE_PHASES[1:],
            "Parquet", "ckpt save", "ckpt load", "iteration"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in sorted(records, key=_key):
        last = r["iterations"][-1]
        ph = last["phases"]
        row = [
            r["size"], _label(r), f"{r['n_params'] / 1e6:.1f}M", _s(ph["generation"]),
            _s(r.get("hf_generation_s")), f"{last['generated_tokens'] / ph['generation']:.0f}",
            *(_s(ph.get(p)) for p in TABLE_PHASES[1:]),
            _s(last["parquet_s"]), _s(r["checkpoint_save_s"]), _s(r["checkpoint_load_s"]), _s(last["wall_s"]),
        ]  # fmt: skip
        print("| " + " | ".join(row) + " |")


def memory_table(records: list[dict[str, Any]]) -> None:
    print("\nMemory, bytes, matmul rate and load:\n")
    head = ["size", "algo", "trainer peak RSS", "vLLM tree peak RSS", "store +/iteration",
            "Parquet/iteration", "checkpoint", "matmul rate (fp32)", "load 1-min start/end",
            "tokens P+R"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in sorted(records, key=_key):
        last, rss = r["iterations"][-1], r["peak_rss"]
        row = [
            r["size"], _label(r), f"{max(rss['trainer'], rss['trainer_ru_maxrss']) / GIB:.2f} GiB",
            f"{rss['vllm_tree'] / GIB:.2f} GiB", f"{last['store_bytes_added'] / 1e6:.2f} MB",
            f"{last['parquet_bytes'] / 1e3:.0f} kB", f"{r['checkpoint_bytes'] / 1e9:.3f} GB",
            f"{best_rate(r) / 1e9:.0f} GFLOP/s",
            f"{r['load_at_start'][0]:.1f} / {r['loadavg_end'][0]:.1f}",
            f"{last['prompt_tokens']:.1f}+{last['response_tokens']:.1f}",
        ]  # fmt: skip
        print("| " + " | ".join(row) + " |")


def flops_table(records: list[dict[str, Any]]) -> None:
    print(
        "\nAchieved FLOP/s per phase (model FLOPs / seconds), GFLOP/s and % of the same run's matmul rate:\n"
    )
    head = ["size", "algo", *FLOP_PHASES]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in sorted(records, key=_key):
        flops = features(r, rate=1.0, shaped=False)  # rate 1: the FLOP features are FLOPs
        ph = r["iterations"][-1]["phases"]
        cells = []
        for p, k in FLOP_PHASES.items():
            if p not in flops or not ph.get(p):
                cells.append("–")
                continue
            achieved = flops[p][k] / ph[p]
            cells.append(f"{achieved / 1e9:.1f} ({100 * achieved / best_rate(r):.0f}%)")
        print("| " + " | ".join([r["size"], _label(r), *cells]) + " |")


def orchestration_table(records: list[dict[str, Any]]) -> None:
    print(
        "\nOrchestration (issue 37 item 6): seconds of the last iteration outside the kernels; the last "
        "column: outside, over every iteration after the first (min / median / max, a record of more "
        "than 2 iterations):\n"
    )
    head = ["size", "algo", "iteration", "kernels", "outside", "share", "Prefect tasks", "artifacts+tracking",
            "of which Parquet", "outside, iterations 1+"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in sorted(records, key=_key):
        it = r["iterations"][-1]
        spread = sorted(i["orchestration_s"] for i in r["iterations"][1:])
        row = [
            r["size"], _label(r), _s(it["wall_s"]), _s(it["kernel_s"]), _s(it["orchestration_s"]),
            f"{100 * it['orchestration_s'] / it['wall_s']:.1f}%", _s(it["prefect_s"]), _s(it["artifacts_s"]),
            _s(it["parquet_s"]),
            " / ".join(_s(x) for x in (spread[0], median(spread), spread[-1])) if len(spread) > 1 else "",
        ]  # fmt: skip
        print("| " + " | ".join(row) + " |")


def fit_and_check(records: list[dict[str, Any]], fit_sizes: tuple[str, ...]) -> Calibration | None:
    """Fit on ``fit_sizes``, print predicted vs measured for every record. One rate for all: the highest
    matmul rate measured in any fitted record (the machine without other jobs' load), so the load a
    1-s measurement happened to catch does not move one size's FLOP features against another's."""
    fit = [r for r in records if r["size"] in fit_sizes]
    if not fit:
        return None
    rate = max(best_rate(r) for r in fit)  # the fitted records' only: nothing of a checked size
    bw = max(best_bandwidth(r) for r in fit)
    rows = [(features(r, rate, bw)[p], s) for r in fit for p, s in measured(r).items() if p in features(r)]
    cal = fit_calibration(rows, FIT_FLOOR_S)
    print(f"\nCost model fitted on {sorted({r['size'] for r in fit})} ({len(rows)} phase rows), rate "
          f"{rate / 1e9:.0f} GFLOP/s, bandwidth {bw / 1e9:.1f} GB/s:")  # fmt: skip
    print("  " + ", ".join(f"{k}={v:.3g}" for k, v in asdict(cal).items()))
    for r in sorted(records, key=_key):
        pred = predict(features(r, rate, bw), cal)
        meas = measured(r)
        where = "fitted on" if r["size"] in fit_sizes else "PREDICTED"
        print(f"\n{where} {r['size']} {_label(r)}:\n")
        print("| phase | measured s | predicted s | ratio |\n|---|---|---|---|")
        for p in PHASES:
            if p in pred and p in meas:
                ratio = pred[p] / meas[p] if meas[p] else float("nan")
                flag = "" if 0.75 <= ratio <= 1.25 else " ✗"
                print(f"| {p} | {_s(meas[p])} | {_s(pred[p])} | {ratio:.2f}{flag} |")
        total_m = sum(v for p, v in meas.items() if not p.startswith("checkpoint"))
        total_p = sum(v for p, v in pred.items() if not p.startswith("checkpoint") and p in meas)
        print(f"| iteration (sum) | {_s(total_m)} | {_s(total_p)} | {total_p / total_m:.2f} |")
    return cal


def checkpoint_table(records: list[dict[str, Any]]) -> None:
    print("\nThe checkpoint save split (records that carry it), seconds:\n")
    head = ["size", "algo", "bytes", "free at the save", "save", "policy (folder + store)",
            "trainer state serialised", "store: link + fsync (all files)", "store: sha256 reads (all files)",
            "rest (the trainer state's store put, commit, pruning)"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in sorted(records, key=_key):
        sp = r.get("checkpoint_split")
        if not sp:
            continue
        parts = sp.get("policy", 0.0) + sp.get("state_serialise", 0.0)
        free = measured_free_at_save(r)
        row = [
            r["size"], _label(r), f"{r['checkpoint_bytes'] / 1e9:.2f} GB",
            "–" if free is None else f"{free / 1e9:.2f} GB", _s(r["checkpoint_save_s"]),
            _s(sp.get("policy")), _s(sp.get("state_serialise")), _s(sp.get("store_put_fsync")),
            _s(sp.get("sha256")), _s(r["checkpoint_save_s"] - parts),
        ]  # fmt: skip
        print("| " + " | ".join(row) + " |")


def report(records: list[dict[str, Any]], fit_sizes: tuple[str, ...]) -> None:
    seconds_table(records)
    checkpoint_table(records)
    memory_table(records)
    flops_table(records)
    orchestration_table(records)
    fit_and_check(records, fit_sizes)


def record_from_pipeline(run_dir: str, mlflow_db: str, rate_flops: float, label: str) -> dict[str, Any]:
    """A record of the last iteration of a pipeline run in a local store (``run_dir`` = the store's
    ``runs/<run id>``), for checking the cost model on a run it was not fitted on: its config
    (``run.json``), the lengths of its rollouts, and the kernel seconds its tracking logged
    (``timing_s/*`` in the MLflow database ``mlflow_db``). ``rate_flops``: a matmul rate measured near
    that run (the run measures none)."""
    import json
    import sqlite3
    from dataclasses import replace
    from pathlib import Path

    import pyarrow.parquet as pq

    from verl_core.config import VerlFlowConfig
    from verl_core.planning.cost import workload_of
    from verl_core.planning.geometry import geometry_of

    cfg = VerlFlowConfig.model_validate(json.loads((Path(run_dir) / "run.json").read_text())["config"])
    last = cfg.trainer.total_iterations - 1
    stage = Path(run_dir) / f"iter-{last:04d}" / "rollout"
    manifest = json.loads((stage / "manifest.json").read_text())
    path = next(f["path"] for f in manifest["files"] if f["name"] == "rollouts.parquet")
    table = pq.read_table(stage / path, columns=["prompt_length", "response_length"])
    p, r = (table.column(c).to_pylist() for c in ("prompt_length", "response_length"))
    w = replace(workload_of(cfg, sum(p) / len(p), sum(r) / len(r)), max_new_tokens=max(r))
    with sqlite3.connect(mlflow_db) as db:
        rows = db.execute(
            "select key, value from metrics where key like 'timing_s/%' and step = ?", (last,)
        ).fetchall()
    logged = {k.removeprefix("timing_s/"): v for k, v in rows}
    phases = {("generation" if k == "rollout" else k): v for k, v in logged.items()}
    g = geometry_of(cfg.model)
    return {
        "size": label, "algo": cfg.algorithm.adv_estimator, "geometry": asdict(g), "n_params": g.n_params,
        "workload_model": asdict(w), "rate_flops": rate_flops,
        "iterations": [{"phases": {k: v for k, v in phases.items() if k in PHASES}}],
    }  # fmt: skip


def check_external(
    records: list[dict[str, Any]], external: dict[str, Any], fit_sizes: tuple[str, ...]
) -> None:
    """The cost model fitted on ``fit_sizes`` (at the records' highest rate) against ``external``'s
    kernel phases."""
    fit = [r for r in records if r["size"] in fit_sizes]
    rate = max(best_rate(r) for r in fit)
    bw = max(best_bandwidth(r) for r in fit)
    rows = [(features(r, rate, bw)[p], s) for r in fit for p, s in measured(r).items() if p in features(r)]
    pred = predict(features(external, rate, bw), fit_calibration(rows, FIT_FLOOR_S))
    meas = external["iterations"][-1]["phases"]
    print(f"\nPREDICTED {external['size']} ({external['algo']}, a pipeline run):\n")
    print("| phase | measured s | predicted s | ratio |\n|---|---|---|---|")
    for p in PHASES:
        if p in pred and meas.get(p, 0.0) > 1e-3:  # a skipped phase (old log-probs of one mini-batch)
            print(f"| {p} | {_s(meas[p])} | {_s(pred[p])} | {pred[p] / meas[p]:.2f} |")
