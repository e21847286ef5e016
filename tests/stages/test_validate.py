"""Validation stage on a tiny model: greedy held-out accuracy = mean ``correct`` of the committed
rewards, committed with the policy lineage, skipped on rerun, refused for the wrong policy version."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.floor.locations import iteration_stage, validations
from stages.floor.state import drop_state, get_state, init_state
from stages.validate import validate
from tests.stages.conftest import TINY_RL
from verl_core.run import RunContext


@pytest.fixture
def ctx(tiny_rl: tuple[Path, str]) -> Iterator[RunContext]:
    run = RunContext(run_id="validate", store_url=str(tiny_rl[0]))
    init_state(run, TINY_RL, tiny_rl[1], None)
    yield run
    drop_state(run.run_id)


def test_validation_accuracy_is_the_mean_of_correct(ctx: RunContext, tiny_rl: tuple[Path, str]) -> None:
    store = ctx.store()
    accuracy = validate.fn(ctx, TINY_RL, tiny_rl[1], 0)
    m = store.committed(ctx.run_id, iteration_stage(0, "val"))
    assert m is not None
    rollouts, rewards = store.read_table(m, "rollouts.parquet"), store.read_table(m, "rewards.parquet")
    # rollout.val_n = 1 greedy sample per held-out prompt (8 of them)
    assert rollouts.num_rows == rewards.num_rows == 8
    correct = rewards.column("correct").to_pylist()
    assert accuracy == sum(correct) / len(correct)
    assert m.summary["val/accuracy"] == accuracy and m.summary["iteration_lineage"] == get_state(ctx).lineage
    assert validations(store, ctx.run_id, get_state(ctx).lineage) == {0: accuracy}

    # a rerun reads the committed accuracy and generates nothing
    def no_generation(*args: object, **kwargs: object) -> None:
        raise AssertionError("validation generated again")

    get_state(ctx).engine.generate = no_generation  # type: ignore[method-assign]
    assert validate.fn(ctx, TINY_RL, tiny_rl[1], 0) == accuracy


def test_validation_needs_the_policy_of_its_iteration(ctx: RunContext, tiny_rl: tuple[Path, str]) -> None:
    with pytest.raises(RuntimeError, match="validation at iteration 1 needs policy version 1, have 0"):
        validate.fn(ctx, TINY_RL, tiny_rl[1], 1)
