"""Which failures of the reward and rescore tasks Prefect retries (stages.floor.retry): not a config
error nor a scorer error the same rows raise again; everything else (I/O, timeouts) as before."""

from __future__ import annotations

from prefect.states import Failed

from stages.floor.retry import retry_unless_deterministic
from stages.rescore import rescore
from stages.reward import reward
from verl_core.errors import ConfigError, StoreUnavailableError
from verl_core.reward import RewardError, ScorerCodeError


def _retried(exc: BaseException) -> bool:
    return retry_unless_deterministic(None, None, Failed(data=exc))


def test_deterministic_failures_are_not_retried() -> None:
    assert not _retried(ScorerCodeError("reward scorer 'function' failed on row ...: TypeError: ..."))
    assert not _retried(ConfigError("reward.function: cannot import module 'nosuchmod'"))
    assert _retried(RewardError("reward scorer 'remote' failed on row ...: timed out after 10 s"))
    assert _retried(StoreUnavailableError("the store stayed unreachable"))
    assert _retried(OSError("connection reset"))


def test_the_tasks_with_retries_carry_the_condition_through_with_options() -> None:
    for task in (reward, rescore):
        assert task.retry_condition_fn is retry_unless_deterministic
        assert (
            task.with_options(retries=2, retry_delay_seconds=0).retry_condition_fn
            is retry_unless_deterministic
        )
