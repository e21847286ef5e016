"""Scorers built once per run phase: the reward stage's calls of one run share them (a reward model
would load once, not every iteration) until the run's state is dropped; another run or another reward
config gets its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.floor import scorers
from stages.floor.scorers import run_scorers
from stages.floor.state import drop_state
from stages.reward import reward
from tests.stages.test_reward import Spy, rollouts_table
from verl_core.config import RewardConfig, SandboxConfig
from verl_core.reward import WeightedScorer
from verl_core.runtime.run import RunContext


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[RewardConfig]:
    """The reward sections scorers were built for, in order."""
    seen: list[RewardConfig] = []
    build = scorers.build_scorers

    def counting(cfg: RewardConfig, sandbox: SandboxConfig) -> list[WeightedScorer]:
        seen.append(cfg)
        return build(cfg, sandbox)

    monkeypatch.setattr(scorers, "build_scorers", counting)
    return seen


def test_reward_calls_of_one_run_build_the_scorers_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, builds: list[RewardConfig]
) -> None:
    ctx = RunContext(run_id="scorers-once", store_url=str(tmp_path / "store"))
    drop_state(ctx.run_id)
    stage = ctx.store().open_stage(ctx.run_id, "iter-0000/rollout")
    stage.write_table("rollouts.parquet", rollouts_table(), "rollouts")
    uri = stage.commit()
    monkeypatch.setattr(RunContext, "tracker", lambda self: Spy())
    cfg, sandbox = RewardConfig(), SandboxConfig()
    for iteration in range(3):  # three iterations' reward stages
        reward.fn(ctx, cfg, uri, iteration, 16, sandbox=sandbox)
    assert len(builds) == 1
    assert ctx.store().committed(ctx.run_id, "iter-0002/reward") is not None
    # the run's state dropped (the RL loop's end): the next phase builds them again
    drop_state(ctx.run_id)
    reward.fn(ctx, cfg, uri, 3, 16, sandbox=sandbox)
    assert len(builds) == 2
    drop_state(ctx.run_id)


def test_another_run_or_config_gets_its_own_scorers(builds: list[RewardConfig]) -> None:
    cfg, sandbox = RewardConfig(), SandboxConfig()
    for run in ("scorers-a", "scorers-b"):
        drop_state(run)
    a = run_scorers("scorers-a", cfg, sandbox)
    assert run_scorers("scorers-a", RewardConfig(), SandboxConfig()) is a  # an equal config: the same
    assert run_scorers("scorers-b", cfg, sandbox) is not a
    partial = cfg.model_copy(update={"correct_threshold": 0.5})
    assert run_scorers("scorers-a", partial, sandbox) is not a
    assert run_scorers("scorers-a", cfg, sandbox.model_copy(update={"timeout_s": 3.0})) is not a
    assert builds == [cfg, cfg, partial, cfg]
    for run in ("scorers-a", "scorers-b"):
        drop_state(run)
