"""Scorers built once per RL session: the reward stage's calls inside one session share them (a
reward model would load once, not every iteration) until the session closes; another session or
another reward config gets its own; a reward stage outside a session builds them for its call."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.floor import session as session_module
from stages.floor.session import bound
from stages.reward import reward
from tests.stages.test_reward import Spy, rollouts_table
from tests.stages.test_session import stub_session
from verl_core.config import RewardConfig, SandboxConfig
from verl_core.reward import WeightedScorer
from verl_core.runtime.run import RunContext


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[RewardConfig]:
    """The reward sections scorers were built for, in order."""
    seen: list[RewardConfig] = []
    build = session_module.build_scorers

    def counting(cfg: RewardConfig, sandbox: SandboxConfig) -> list[WeightedScorer]:
        seen.append(cfg)
        return build(cfg, sandbox)

    monkeypatch.setattr(session_module, "build_scorers", counting)
    return seen


@pytest.fixture
def rollouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[RunContext, str]]:
    ctx = RunContext(run_id="scorers-once", store_url=str(tmp_path / "store"))
    stage = ctx.store().open_stage(ctx.run_id, "iter-0000/rollout")
    stage.write_table("rollouts.parquet", rollouts_table(), "rollouts")
    monkeypatch.setattr(RunContext, "tracker", lambda self: Spy())
    yield ctx, stage.commit()


def test_reward_calls_of_one_session_build_the_scorers_once(
    rollouts: tuple[RunContext, str], builds: list[RewardConfig]
) -> None:
    ctx, uri = rollouts
    cfg, sandbox = RewardConfig(), SandboxConfig()
    session = stub_session(ctx.run_id)
    with bound(session):
        for iteration in range(3):  # three iterations' reward stages
            reward.fn(ctx, cfg, uri, iteration, 16, sandbox=sandbox)
    assert len(builds) == 1
    assert ctx.store().committed(ctx.run_id, "iter-0002/reward") is not None
    session.close()  # the loop's end: the scorers go with the session, and its engine is closed
    assert session.built_scorers == {} and session.engine.closed  # type: ignore[attr-defined]
    with bound(stub_session(ctx.run_id)):  # the run's next session builds them again
        reward.fn(ctx, cfg, uri, 3, 16, sandbox=sandbox)
    assert len(builds) == 2


def test_outside_a_session_each_reward_call_builds_its_scorers(
    rollouts: tuple[RunContext, str], builds: list[RewardConfig]
) -> None:
    ctx, uri = rollouts
    cfg, sandbox = RewardConfig(), SandboxConfig()
    reward.fn(ctx, cfg, uri, 0, 16, sandbox=sandbox)
    with bound(stub_session("another-run")):  # another run's session is not this run's
        reward.fn(ctx, cfg, uri, 1, 16, sandbox=sandbox)
    assert len(builds) == 2


def test_another_session_or_config_gets_its_own_scorers(builds: list[RewardConfig]) -> None:
    cfg, sandbox = RewardConfig(), SandboxConfig()
    a_session, b_session = stub_session("scorers-a"), stub_session("scorers-b")
    a = a_session.scorers(cfg, sandbox)
    assert a_session.scorers(RewardConfig(), SandboxConfig()) is a  # an equal config: the same
    assert b_session.scorers(cfg, sandbox) is not a
    partial = cfg.model_copy(update={"correct_threshold": 0.5})
    assert a_session.scorers(partial, sandbox) is not a
    assert a_session.scorers(cfg, sandbox.model_copy(update={"timeout_s": 3.0})) is not a
    assert builds == [cfg, cfg, partial, cfg]
