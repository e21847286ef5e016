"""A fork's or replay's parent is checked once per run (:mod:`flows.parent_check`): ``verl-flow run
--fork`` and ``verl-flow replay`` check before any flow starts and hand their check to the pipeline,
which then does not check again; the replay flow gets the config the CLI built; a pipeline entered at
another door (Python, a deployment) checks the parent itself. Each check reads every replayed
iteration's manifests, so the tests count the calls of ``check_parent`` (a recording wrapper) through
the real CLI and the flows' bodies (``.fn``: without Prefect's engine, whose temporary server would take
most of the test's time), stopped right after the pipeline's check (no stage runs)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import flows.parent_check
import flows.pipeline
import flows.replay
import stages.floor.parent
from flows.cli import app
from flows.parent_check import ParentCheck, check_once, check_start
from stages.floor.locations import ckpt_stage, iteration_stage
from verl_core.config import load_config, with_overrides
from verl_core.errors import ConfigError
from verl_core.store import ArtifactStore

TINY = str(Path(__file__).resolve().parents[1] / "reliability" / "tiny.yaml")


class Stop(Exception):
    """Raised where the pipeline's work would start."""


def _commit(store: ArtifactStore, run: str, stage: str) -> None:
    w = store.open_stage(run, stage)
    w.write_bytes("x.bin", stage.encode())
    w.commit()


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    """Run P (tiny config, 3 iterations): checkpoint 2, rollouts and rewards of iterations 0-2."""
    st = ArtifactStore(str(tmp_path / "runs"))
    cfg = load_config(TINY, ["trainer.total_iterations=3", f"store.url={st.url}"])
    st.write_run_record("P", cfg.model_dump(mode="json"), cfg.config_hash())
    _commit(st, "P", ckpt_stage(2))
    for it in range(3):
        _commit(st, "P", iteration_stage(it, "rollout"))
        _commit(st, "P", iteration_stage(it, "reward"))
    return st


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, arg: int) -> list[str]:
    """Wrap ``module.name`` so that every call is recorded (its positional argument ``arg``)."""
    calls: list[str] = []
    real: Callable[..., Any] = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(str(args[arg]))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The run ids ``check_parent`` was called for; the flows run as plain functions and the pipeline
    stops right after its check."""

    def stop(*_: Any) -> None:
        raise Stop("stopped after the parent's check")

    monkeypatch.setattr(flows.pipeline, "fetch_initial_model", stop)
    monkeypatch.setattr(flows.pipeline, "resolve_snapshot", flows.pipeline.resolve_snapshot.fn)
    pipeline = flows.pipeline.rlhf_pipeline.fn
    monkeypatch.setattr(flows.pipeline, "rlhf_pipeline", pipeline)  # as the CLI imports it
    monkeypatch.setattr(flows.replay, "rlhf_pipeline", pipeline)  # as the replay flow calls it
    monkeypatch.setattr(flows.replay, "replay_flow", flows.replay.replay_flow.fn)
    monkeypatch.setattr(flows.replay, "get_run_logger", lambda: logging.getLogger("replay"))  # no flow run
    return _counting(monkeypatch, flows.parent_check, "check_parent", 2)  # (store, cfg, run_id)


def test_fork_through_the_cli_is_checked_once(store: ArtifactStore, checks: list[str]) -> None:
    args = ["run", TINY, f"store.url={store.url}", "trainer.total_iterations=3", "--fork", "P@2"]
    r = CliRunner().invoke(app, [*args, "--run-id", "F"])
    assert r.exit_code == 1 and "stopped after the parent's check" in r.stderr, r.output
    assert checks == ["F"]  # the CLI's check, handed to the pipeline: one, not two


def test_replay_through_the_cli_is_checked_once_and_built_once(
    store: ArtifactStore, checks: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # replay_config(store, run_id, ...): the CLI imports it when it runs, the replay flow at its import
    builds = _counting(monkeypatch, stages.floor.parent, "replay_config", 1)
    flow_builds = _counting(monkeypatch, flows.replay, "replay_config", 1)
    r = CliRunner().invoke(app, ["replay", "P", "--from", "2", "--store", store.url, "--run-id", "R"])
    assert r.exit_code == 1 and "stopped after the parent's check" in r.stderr, r.output
    assert checks == ["R"]  # once: was three times (CLI, replay flow, pipeline)
    assert (builds, flow_builds) == (["P"], [])  # the replay flow got the CLI's config


def test_a_pipeline_entered_at_another_door_checks_the_parent_itself(
    store: ArtifactStore, checks: list[str]
) -> None:
    # Python or a deployment's flow run: no check handed over, the pipeline makes it
    fork = load_config(TINY, ["trainer.total_iterations=3", f"store.url={store.url}"])
    fork = with_overrides(fork, ["parent.run_id=P", "parent.iteration=2"])
    with pytest.raises(Stop):
        flows.pipeline.rlhf_pipeline(config=fork, run_id="F")
    assert checks == ["F"]
    # the replay deployment: the flow builds the config, the pipeline checks
    with pytest.raises(Stop):
        flows.replay.replay_flow(run_id="P", start_iteration=2, store_url=store.url, new_run_id="R")
    assert checks == ["F", "R"]


def test_a_handed_over_check_counts_only_for_its_run_store_and_config(
    store: ArtifactStore, checks: list[str]
) -> None:
    fork = load_config(TINY, ["trainer.total_iterations=3", f"store.url={store.url}"])
    fork = with_overrides(fork, ["parent.run_id=P", "parent.iteration=2"])
    done = check_start(store, fork, "F")
    assert done == ParentCheck(run_id="F", store_url=store.url, config_hash=fork.config_hash())
    check_once(store, fork, "F", done)  # the same run, store and config: not again
    assert checks == ["F"]
    other = with_overrides(fork, ["trainer.seed=7"])  # e.g. a data snapshot changed the config since
    check_once(store, other, "F", done)
    check_once(store, fork, "G", done)  # another run id: its own checkpoints decide
    assert checks == ["F", "F", "G"]
    plain = fork.model_copy(update={"parent": None})
    assert check_start(store, plain, "F") is None and checks == ["F", "F", "G"]  # no parent, no check


def test_the_replay_flow_refuses_a_config_that_is_not_the_replay_it_is_asked_for(
    store: ArtifactStore, checks: list[str]
) -> None:
    cfg = stages.floor.parent.replay_config(store, "P", 2, [], None)
    with pytest.raises(ConfigError, match=r"^config.parent: .* is not a replay of "):
        flows.replay.replay_flow(run_id="P", start_iteration=1, store_url=store.url, config=cfg)
    assert checks == []  # refused before the pipeline
