"""verl's key names on the commands that run: ``verl-flow run`` prints one line per verl key it
translated before it starts (as ``config show``), and ``verl-flow rescore`` accepts verl's reward keys
(``custom_reward_function.path`` / ``.name`` set ``reward.function``), judged after translation."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tests.flows.test_rescore_verl_function import ROWS, RUN, VERL_STYLE, run_store
from verl_core.config import VerlFlowConfig

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
run_cli = importlib.import_module("flows.cli.run")  # the module (flows.cli.run is also the command)
__all__ = ["run_store"]  # the fixture: a one-iteration run whose rollouts the GSM8K rule scored


def test_run_prints_each_verl_translation_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[VerlFlowConfig] = []

    def start(cfg: VerlFlowConfig, *_: object, **__: object) -> None:  # the pipeline, not run here
        started.append(cfg)

    monkeypatch.setattr(run_cli, "_run_logged", start)
    verl = ["actor_rollout_ref.actor.optim.lr=7e-5", "trainer.total_training_steps=3"]
    result = CliRunner().invoke(app, ["run", QUICKSTART, f"store.url={tmp_path}", *verl, "rollout.n=2"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [  # one line per verl key; rollout.n is ours: no line
        "verl key actor_rollout_ref.actor.optim.lr → actor.lr=7e-5",
        "verl key trainer.total_training_steps → trainer.total_iterations=3",
    ]
    (cfg,) = started
    assert (cfg.actor.lr, cfg.trainer.total_iterations, cfg.rollout.n) == (7e-5, 3, 2)


def test_run_prints_which_of_iterations_and_epochs_ends_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_cli, "_run_logged", lambda *_, **__: None)
    args = ["trainer.total_iterations=4", "trainer.total_epochs=2", "custom_reward_function.name=f"]
    result = CliRunner().invoke(app, ["run", QUICKSTART, f"store.url={tmp_path}", *args])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        # a value in brackets stays text (no console markup)
        "verl key custom_reward_function.name → nothing to set (read with custom_reward_function.path)",
        "trainer.total_iterations=4 and trainer.total_epochs=2 are both given: the run stops at whichever "
        "comes first (as verl with total_training_steps)",
    ]


def test_rescore_takes_verls_reward_keys(
    run_store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "my_reward.py").write_text(VERL_STYLE)
    monkeypatch.chdir(tmp_path / "work")
    verl = ["custom_reward_function.path=my_reward.py", "custom_reward_function.name=compute_score"]
    result = CliRunner().invoke(app, ["rescore", RUN, "--store", run_store, "--name", "verlkeys", *verl])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[:2] == [
        "verl key custom_reward_function.path → reward.function=my_reward.py:compute_score, "
        "reward.scorers=[function] (FILE:NAME in reward.function, the only scorer)",
        "verl key custom_reward_function.name → nothing to set (read with custom_reward_function.path)",
    ]
    from verl_core.store import ArtifactStore

    report = ArtifactStore(run_store).committed(RUN, "rescore/verlkeys/report")
    assert report is not None
    # the verl-style function is the strict GSM8K rule: the same verdict on all 5 rows
    assert report.summary["total"]["agreement"] == 1.0 and report.summary["total"]["rows"] == len(ROWS)


def test_rescore_refuses_a_verl_key_outside_the_reward(run_store: str) -> None:
    # verl's actor learning rate is our actor.lr: still not a reward setting
    result = CliRunner().invoke(
        app, ["rescore", RUN, "--store", run_store, "actor_rollout_ref.actor.optim.lr=1"]
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: 'actor.lr': a rescore changes only reward.* and sandbox.* settings (the rollouts are the "
        "run's own)"
    )
