"""A fork's or replay's parent is checked once per run (:mod:`flows.parent_check`): ``verl-flow run
--fork`` and ``verl-flow replay`` check before any flow starts and hand their check over to the
pipeline in this process (never as a flow parameter), which then does not check again; the replay flow
uses the config the CLI built when it is the replay asked for; a pipeline entered at another door
(Python, a deployment, a retried flow run) checks the parent itself. Each check reads every replayed
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
from flows.parent_check import BuiltReplay, ParentCheck, check_once, check_start, handed_over
from stages.floor.locations import ckpt_stage, iteration_stage
from verl_core.config import load_config, with_overrides
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
    with handed_over(done):
        check_once(store, fork, "F")  # the same run, store and config: not again
        assert checks == ["F"]
        other = with_overrides(fork, ["trainer.seed=7"])  # e.g. a data snapshot changed the config since
        check_once(store, other, "F")
        check_once(store, fork, "G")  # another run id: its own checkpoints decide
        assert checks == ["F", "F", "G"]
    check_once(store, fork, "F")  # outside the block nothing is handed over (a Prefect "Retry")
    assert checks == ["F", "F", "G", "F"]
    plain = fork.model_copy(update={"parent": None})
    assert check_start(store, plain, "F") is None and len(checks) == 4  # no parent, no check


def test_the_parent_check_and_config_are_no_flow_parameters() -> None:
    # a deployment's Run form (and a retry's saved parameters) could otherwise skip the check
    assert set(flows.pipeline.rlhf_pipeline.parameters.properties) == {
        "config", "overrides", "run_id", "config_file",
    }  # fmt: skip
    assert set(flows.replay.replay_flow.parameters.properties) == {
        "run_id", "start_iteration", "overrides", "new_run_id", "rewards", "store_url",
    }  # fmt: skip


def test_the_replay_flow_builds_and_checks_again_when_the_handed_config_is_another_replay(
    store: ArtifactStore, checks: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    flow_builds = _counting(monkeypatch, flows.replay, "replay_config", 1)
    cfg = stages.floor.parent.replay_config(store, "P", 2, [], None)
    done = check_start(store, cfg, "R")
    assert checks == ["R"]
    kl = ["algorithm.kl_ctrl.kl_coef=0.01"]
    asked: dict[str, Any] = {"run_id": "P", "start_iteration": 2, "store_url": store.url, "new_run_id": "R"}
    for other in (
        BuiltReplay("P", 2, (), None, store.url, cfg),  # asked with overrides the config lacks
        BuiltReplay("P", 2, tuple(kl), None, f"{store.url}-other", cfg),  # another store
        BuiltReplay("P", 2, tuple(kl), "v2", store.url, cfg),  # another rescore's rewards
    ):
        with handed_over(done, other), pytest.raises(Stop):
            flows.replay.replay_flow(**asked, overrides=kl)
    # each time built here, and its config (another hash) checked by the pipeline
    assert flow_builds == ["P"] * 3 and checks == ["R"] * 4
    with handed_over(done, BuiltReplay("P", 2, (), None, store.url, cfg)), pytest.raises(Stop):
        flows.replay.replay_flow(**asked)  # the replay asked for: the handed config and check
    assert flow_builds == ["P"] * 3 and checks == ["R"] * 4


def test_a_fork_whose_parent_check_finds_a_config_error_exits_2_in_one_line(
    store: ArtifactStore, checks: list[str]
) -> None:
    # run L's recorded parent is L itself: the check walks up to the root and finds a loop (ConfigError)
    loop = load_config(TINY, ["trainer.total_iterations=3", f"store.url={store.url}"])
    loop = with_overrides(loop, ["parent.run_id=L", "parent.iteration=2"])
    store.write_run_record("L", loop.model_dump(mode="json"), loop.config_hash())
    _commit(store, "L", ckpt_stage(2))
    args = ["run", TINY, f"store.url={store.url}", "trainer.total_iterations=3", "--fork", "L@2"]
    r = CliRunner().invoke(app, [*args, "--run-id", "F"])
    assert r.exit_code == 2, r.output  # the documented config-error code (flows/cli/run.py), not 1
    assert r.stderr.strip().splitlines() == ["error: parent.run_id: the parent chain of run 'L' loops"], (
        r.stderr
    )
    assert checks == ["F"]
