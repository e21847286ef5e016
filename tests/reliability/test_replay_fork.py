"""Forks and replays end to end, on a copy of the session's uninterrupted tiny run ``left`` (2 iterations,
its only checkpoint ckpt/iter-0002).

The family built once for the module (every run a real ``verl-flow`` subprocess):

    left ── F   fork of left@2: 5 iterations, a checkpoint after each (3, 4, 5 kept), no export
            ├── G   fork of F@3 with F's config; killed -9 writing ckpt/iter-0005, then rerun
            ├── Rp  replay of F from 3, F's settings; killed -9 writing ckpt/iter-0005, then rerun
            └── Rr  replay of F from 3 with algorithm.adv_estimator=rloo, MLflow on

Expectations: G and Rp make exactly F's updates 3 and 4 (update tables, checkpoints 4 and 5, trainer
states included, byte for byte), each resuming after the kill from its own checkpoint 4 without redoing
a committed stage; Rr trains on F's stored rollouts (no rollout or reward stage of its own) and its
update tables differ from F's, with the rollout/trainer mismatch logged for both iterations and large
only for the second (off-policy) one; refusals are one line before any work; run.json, MLflow tags and
``runs show`` link the family.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tests.reliability.conftest import (
    REPO,
    TINY,
    Pipeline,
    Reference,
    Result,
    attempts,
    fingerprint,
    finish,
)
from verl_core.store import ArtifactStore

F_SETTINGS = [
    "trainer.total_iterations=5",
    "trainer.save_freq=1",
    "trainer.max_ckpt_to_keep=3",
    "export.enable=false",
]
KILL = "checkpoint-save-5"  # ckpt/iter-0005's policy written, its trainer state not


@dataclass(frozen=True)
class Family:
    store_url: str
    killed: dict[str, Result]
    before: dict[str, dict[str, str]]  # {run: {stage: attempt}} right after the kill
    done: dict[str, Result]


def _replay(
    pipeline: Pipeline, store_url: str, run_id: str, overrides: list[str], kill_at: str | None = None
) -> subprocess.Popen[str]:
    kill = ["--kill-at", kill_at] if kill_at else []
    args = ["replay", "F", "--from", "3", *overrides, "--store", store_url, "--run-id", run_id]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.runner", *kill, "--", *args],
        cwd=str(REPO), env=pipeline.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def family(pipeline: Pipeline, reference: Reference, tmp_path_factory: pytest.TempPathFactory) -> Family:
    root = tmp_path_factory.mktemp("family")
    store_url = str(root / "store")
    shutil.copytree(Path(reference.store_url) / "runs" / "left", root / "store" / "runs" / "left")
    f = pipeline.run(store_url, "F", overrides=[*F_SETTINGS, "--fork", "left@2"])
    assert f.returncode == 0, f.output[-4000:]

    t0 = time.perf_counter()  # G and Rp killed then rerun as soon as each is dead, Rr beside them
    fork = [*F_SETTINGS, "--fork", "F@3"]
    rr = _replay(pipeline, store_url, "Rr", ["algorithm.adv_estimator=rloo", "tracking.enabled=true"])
    starts = {
        "G": lambda kill: pipeline.start(store_url, "G", overrides=fork, kill_at=kill),
        "Rp": lambda kill: _replay(pipeline, store_url, "Rp", [], kill_at=kill),
    }
    killing = {run: start(KILL) for run, start in starts.items()}
    killed, before, again = {}, {}, {}
    for run, proc in killing.items():
        killed[run] = r = finish(proc, t0)
        assert r.returncode == -signal.SIGKILL and r.killed_at() == KILL, r.output[-4000:]
        before[run] = attempts(store_url, run)
        again[run] = starts[run](None)  # the same command again: it resumes
    done = {run: finish(proc, t0) for run, proc in {**again, "Rr": rr}.items()}
    for r in done.values():
        assert r.returncode == 0, r.output[-4000:]
    return Family(store_url, killed, before, done)


def _rl_prints(store_url: str, run_id: str) -> dict[str, str]:
    """Fingerprint of the run's RL artifacts (iterations and checkpoints)."""
    return {k: v for k, v in fingerprint(store_url, run_id).items() if k.startswith(("iter-", "ckpt/"))}


@pytest.mark.parametrize("run", ["G", "Rp"])
def test_killed_fork_and_replay_resume_from_their_own_checkpoint(family: Family, run: str) -> None:
    before, now = family.before[run], attempts(family.store_url, run)
    # the kill came after ckpt/iter-0004 (and update 3, which it published) was committed
    assert {"ckpt/iter-0004", "iter-0003/update"} <= set(before) and "ckpt/iter-0005" not in before
    assert {s: now[s] for s in before} == before  # nothing committed ran again
    assert {"iter-0004/update", "ckpt/iter-0005"} <= set(now)


def test_fork_with_the_parents_config_makes_the_parents_next_updates(family: Family) -> None:
    f, g = _rl_prints(family.store_url, "F"), _rl_prints(family.store_url, "G")
    # G starts from F's ckpt 3: its own rollouts, rewards, updates 3 and 4, checkpoints 4 and 5
    assert {k.split("/")[0] for k in g} == {"iter-0003", "iter-0004", "ckpt"}
    assert "iter-0003/update/update.parquet" in g and "ckpt/iter-0005/policy/model.safetensors" in g
    assert {k: f[k] for k in g} == g  # byte for byte (trainer states: tensors and torch RNG)
    store = ArtifactStore(family.store_url)
    record = store.read_run_record("G").config
    assert record["parent"] == {"run_id": "F", "iteration": 3, "replay": False, "rewards": None}
    assert "sft" not in attempts(family.store_url, "G")  # a fork skips SFT


def test_unchanged_replay_reproduces_the_parents_checkpoints(family: Family) -> None:
    f, rp = _rl_prints(family.store_url, "F"), _rl_prints(family.store_url, "Rp")
    assert {k.split("/")[1] for k in rp if k.startswith("iter-")} == {"update"}  # nothing sampled
    assert {k for k in rp if k.startswith("ckpt/")} >= {
        "ckpt/iter-0004/policy/model.safetensors", "ckpt/iter-0005/policy/model.safetensors",
        "ckpt/iter-0005/trainer_state.pt", "ckpt/iter-0005/critic/model.safetensors",
    }  # fmt: skip
    assert {k: f[k] for k in rp} == rp
    store = ArtifactStore(family.store_url)
    update = store.committed("Rp", "iter-0004/update")
    assert update is not None
    assert set(update.inputs) == {"rollout", "reward"}  # lineage: F's stored stages
    assert {v["uri"] for v in update.inputs.values()} == {
        store.manifest_uri("F", "iter-0004/rollout"),
        store.manifest_uri("F", "iter-0004/reward"),
    }


def test_replay_with_rloo_trains_on_the_parents_rollouts_and_differs(family: Family) -> None:
    f, rr = _rl_prints(family.store_url, "F"), _rl_prints(family.store_url, "Rr")
    for it in (3, 4):
        key = f"iter-000{it}/update/update.parquet"
        assert rr[key] != f[key], key  # RLOO advantages instead of GAE's
    assert rr["ckpt/iter-0005/policy/model.safetensors"] != f["ckpt/iter-0005/policy/model.safetensors"]
    assert "ckpt/iter-0005/critic/model.safetensors" not in rr  # rloo trains no critic
    store = ArtifactStore(family.store_url)
    mismatch = {}
    for it in (3, 4):
        m = store.committed("Rr", f"iter-000{it}/update")
        assert m is not None
        mismatch[it] = m.summary["rollout_corr/log_prob_abs_diff_max"]
    # iteration 3's rollouts were sampled by F's policy 3 = Rr's start (on-policy: only the engine vs
    # trainer forward differ, ~1e-6); iteration 4's by F's policy 4, which Rr's RLOO update did not make
    assert mismatch[3] < 1e-4 < mismatch[4], mismatch


def test_replay_mlflow_tags_and_mismatch_metrics(family: Family) -> None:
    from mlflow.tracking import MlflowClient

    from flows.runs import find_mlflow_run
    from verl_core.runtime.tracking import default_tracking_uri

    uri = default_tracking_uri(ArtifactStore(family.store_url).url)
    mlflow_id = find_mlflow_run(uri, "verl-flow", "Rr")
    assert mlflow_id is not None
    client = MlflowClient(tracking_uri=uri)
    tags = client.get_run(mlflow_id).data.tags
    assert tags["verl_flow.parent_run_id"] == "F" and tags["verl_flow.parent_iteration"] == "3"
    assert tags["verl_flow.kind"] == "replay" and "mlflow.parentRunId" not in tags  # siblings
    steps = [m.step for m in client.get_metric_history(mlflow_id, "rollout_corr/kl")]
    assert sorted(steps) == [3, 4]  # the mismatch, every replayed iteration


def test_runs_show_prints_the_family(family: Family) -> None:
    runner = CliRunner()
    shown = runner.invoke(app, ["runs", "show", "F", "--store", family.store_url])
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    at = lines.index("family (verl-flow run --fork, verl-flow replay):")
    assert lines[at + 1 : at + 6] == [
        "  left",
        "    F  fork of left@2   <- this run",
        "      G  fork of F@3",
        "      Rp  replay of F@3",
        "      Rr  replay of F@3",
    ]
    assert "replays of this run:" in lines and "forks of this run:" in lines
    data = json.loads(
        runner.invoke(app, ["runs", "show", "Rr", "--store", family.store_url, "--json"]).stdout
    )
    assert data["parent"]["run_id"] == "F" and data["parent"]["kind"] == "replay"
    assert [a["run_id"] for a in data["ancestors"]] == ["F", "left"]
    assert data["descendants"] == [] and data["forks"] == [] and data["replays"] == []
    data = json.loads(runner.invoke(app, ["runs", "show", "F", "--store", family.store_url, "--json"]).stdout)
    assert [r["run_id"] for r in data["replays"]] == ["Rp", "Rr"] and [
        r["run_id"] for r in data["forks"]
    ] == ["G"]


@pytest.mark.parametrize(
    "args, code, line",
    [
        (
            ["replay", "F", "--from", "3", "rollout.n=4"],
            2,
            "'rollout.n': a replay trains on the parent's stored",
        ),
        (["replay", "F", "--from", "1"], 1, "run 'F' has no checkpoint at iteration 1 (available: 3, 4, 5;"),
        (["replay", "F", "--from", "5"], 2, "parent.iteration: 5 leaves nothing to train"),
        (["replay", "nope", "--from", "3"], 1, "parent.run_id: no run 'nope' in"),
        (
            ["run", TINY, *F_SETTINGS, "--fork", "F@2"],
            1,
            "run 'F' has no checkpoint at iteration 2 (available: 3, 4, 5;",
        ),
    ],
)
def test_refusals_are_one_line_before_any_work(family: Family, args: list[str], code: int, line: str) -> None:
    runs = ArtifactStore(family.store_url).list_runs()
    store = ["--store", family.store_url] if args[0] == "replay" else [f"store.url={family.store_url}"]
    r = CliRunner().invoke(app, [*args, *store])
    assert r.exit_code == code, r.output
    assert line in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert ArtifactStore(family.store_url).list_runs() == runs  # no run was started
