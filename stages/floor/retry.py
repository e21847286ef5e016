"""Which task failures Prefect retries: only those that another attempt may pass (I/O, a timeout, a
dead worker). A config error or a scorer error that the same input raises again
(:class:`~verl_core.reward.ScorerCodeError`, e.g. a custom reward function's ``TypeError``) fails the
task at once, without the retries' delay and their repeated tracebacks.

Used as ``retry_condition_fn`` of the tasks that have retries for their I/O (the reward stage, the
rescore stage): Prefect calls it with the failed state, whose ``data`` is the exception.
"""

from __future__ import annotations

from typing import Any

from verl_core.errors import ConfigError
from verl_core.reward import ScorerCodeError

NOT_RETRIED: tuple[type[BaseException], ...] = (ConfigError, ScorerCodeError)


def retry_unless_deterministic(task: Any, task_run: Any, state: Any) -> bool:
    """False when the failure of ``state`` is one of :data:`NOT_RETRIED`, True otherwise."""
    return not isinstance(getattr(state, "data", None), NOT_RETRIED)
