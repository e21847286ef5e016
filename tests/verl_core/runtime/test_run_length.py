"""The planned-vs-completed check: a short count fails with both numbers; a plan capped for a stated
reason, or ended by a stop request, does not."""

from __future__ import annotations

import pytest

from verl_core.runtime.run_length import ShortRunError, StepCount, check_completed


def _count(planned: int, completed: int, **kw: object) -> StepCount:
    return StepCount.model_validate(
        {"unit": "RL iterations", "requested": planned, "planned": planned, "completed": completed, **kw}
    )


def test_a_complete_count_passes() -> None:
    done = _count(20, 20)
    assert check_completed("rl", done) is done and not done.short


def test_a_short_count_fails_naming_planned_and_completed() -> None:
    with pytest.raises(ShortRunError, match=r"^rl: completed 12 of 20 planned RL iterations, and no stop"):
        check_completed("rl", _count(20, 12))
    with pytest.raises(ShortRunError, match=r"8 missing"):
        check_completed("rl", _count(20, 12))


def test_a_cap_explains_a_smaller_plan_but_not_a_short_run() -> None:
    # total_iterations=20, but 2 epochs over 24 prompts in batches of 8: ceil(2·24/8) = 6 planned
    capped = _count(6, 6, requested=20, cap="trainer.total_epochs=2 passes over the training prompts")
    assert check_completed("rl", capped) is capped
    with pytest.raises(ShortRunError, match=r"completed 5 of 6 planned RL iterations, capped from 20 by "):
        check_completed("rl", _count(6, 5, requested=20, cap="trainer.total_epochs=2"))


def test_a_stop_request_explains_a_short_run() -> None:
    stopped = _count(20, 12, stop="stop requested by the user at iteration 12")
    assert check_completed("rl", stopped) is stopped and not stopped.short
