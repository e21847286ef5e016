"""Custom reward functions that misbehave, for the bad-input corpus (``reward.function`` paths
``tests.data.bad.bad_rewards:<name>``)."""

from __future__ import annotations

import time
from typing import Any


def raises(completion: str, **kwargs: Any) -> float:
    raise RuntimeError("the grader's database is down")


def hangs(completion: str, **kwargs: Any) -> float:
    time.sleep(3600)
    return 0.0


def returns_nan(completion: str, **kwargs: Any) -> float:
    return float("nan")


def returns_text(completion: str, **kwargs: Any) -> Any:
    return "high"
