"""``verl-flow rescore`` end to end on a copy of the session's uninterrupted tiny run (``left``: training
iterations 0 and 1, an eval of the export), with the run's own reward settings: killed with SIGKILL
while publishing the second iteration's rescored rewards, then rerun, it finishes without redoing
the committed iteration; every rescored rewards file equals the stored one byte for byte; the run's
own artifacts are untouched; ``runs show`` lists the rescore."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from flows.cli import app
from tests.reliability.conftest import (
    REPO,
    Pipeline,
    Reference,
    Result,
    attempts,
    fingerprint,
    finish,
    uncommitted,
)
from verl_core.store import ArtifactStore

RUN = "left"
STAGES = ["iter-0000/reward", "iter-0001/reward", "eval/export-iter-0002"]


def _rescore(pipeline: Pipeline, store_url: str, kill_at: str | None = None) -> Result:
    kill = ["--kill-at", kill_at] if kill_at else []
    args = ["rescore", RUN, "--store", store_url, "--name", "same"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.runner", *kill, "--", *args],
        cwd=str(REPO), env=pipeline.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return finish(proc, t0)


def _own(prints: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in prints.items() if not k.startswith("rescore/")}


def test_killed_rescore_resumes_and_reproduces_the_stored_rewards(
    pipeline: Pipeline, reference: Reference, tmp_path: Path
) -> None:
    store_url = str(tmp_path / "store")
    shutil.copytree(Path(reference.store_url) / "runs" / RUN, tmp_path / "store" / "runs" / RUN)
    store = ArtifactStore(store_url)
    own = fingerprint(store_url, RUN)

    killed = _rescore(pipeline, store_url, kill_at="rescore-second-iteration")
    assert killed.returncode == -signal.SIGKILL, killed.output[-4000:]
    assert killed.killed_at() == "rescore-second-iteration", killed.output[-4000:]
    before = attempts(store_url, RUN)
    assert "rescore/same/iter-0000/reward" in before and "rescore/same/iter-0001/reward" not in before
    written = store.fs.find(store.path("runs", RUN, "rescore", "same", "iter-0001", "reward"))
    assert any(p.endswith("rewards.parquet") for p in written)  # written, never published

    done = _rescore(pipeline, store_url)
    assert done.returncode == 0, done.output[-4000:]
    now = attempts(store_url, RUN)
    assert {s: now[s] for s in before} == before  # nothing committed was redone
    assert {f"rescore/same/{s}" for s in STAGES} | {"rescore/same/report"} <= set(now)
    for stage in STAGES:
        old, new = store.committed(RUN, stage), store.committed(RUN, f"rescore/same/{stage}")
        assert old is not None and new is not None
        for f in new.files:
            assert f.sha256 == old.file(f.name).sha256, (stage, f.name)
    assert _own(fingerprint(store_url, RUN)) == own  # the run's own artifacts, untouched
    assert uncommitted(store_url, RUN) == []  # the killed attempt cleaned up, the lease released
    report = store.committed(RUN, "rescore/same/report")
    assert report is not None and report.summary["total"]["agreement"] == 1.0
    assert "wall time" in done.stdout and "report:" in done.stdout

    shown = CliRunner().invoke(app, ["runs", "show", RUN, "--store", store_url])
    assert shown.exit_code == 0, shown.output
    assert "rescores (verl-flow rescore):" in shown.stdout and "  same  reward config " in shown.stdout
    assert "rescore/same/iter-0000/reward" not in shown.stdout  # one line per rescore, not its stages
    as_json = json.loads(
        CliRunner().invoke(app, ["runs", "show", RUN, "--store", store_url, "--json"]).stdout
    )
    [entry] = as_json["rescores"]
    assert entry["name"] == "same" and entry["stages"] == len(STAGES) and entry["agreement"] == 1.0
