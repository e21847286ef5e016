"""Custom reward functions (``reward.function``) for the RL loop tests."""

from __future__ import annotations

from typing import Any


def digit_count(completion: str, **kwargs: Any) -> float:
    """Number of digits in the completion: differs between samples of a tiny random policy, so GRPO
    advantages (and the gradients) are not all zero."""
    return float(sum(ch.isdigit() for ch in completion))


def infinite(completion: str, **kwargs: Any) -> float:
    """+inf for every sample (passes the reward function's NaN check)."""
    return float("inf")
