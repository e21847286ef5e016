"""Custom reward functions (``reward.function``) for the RL loop tests."""

from __future__ import annotations

import zlib
from typing import Any


def digit_count(completion: str, **kwargs: Any) -> float:
    """Number of digits in the completion: differs between samples of a tiny random policy, so GRPO
    advantages (and the gradients) are not all zero."""
    return float(sum(ch.isdigit() for ch in completion))


def text_hash(completion: str, **kwargs: Any) -> float:
    """A score in [0, 1) from a hash of the completion: two different samples almost surely score
    differently, so every group of a random policy has non-zero GRPO advantages."""
    return (zlib.crc32(completion.encode()) % 1000) / 1000


def infinite(completion: str, **kwargs: Any) -> float:
    """+inf for every sample (passes the reward function's NaN check)."""
    return float("inf")


def half_credit(completion: str, *, ground_truth: str, **kwargs: Any) -> float:
    """Partial credit, deterministic in the text: 1.0 when the character codes of the completion and
    its ground truth sum to an even number, else 0.5. Below the default ``reward.correct_threshold``
    (1.0), a 0.5 is not correct: the mean score and the accuracy of a batch differ."""
    return 1.0 if sum(map(ord, completion + ground_truth)) % 2 == 0 else 0.5


def uniform_when_even(completion: str, *, ground_truth: str, **kwargs: Any) -> float:
    """0.0 for every sample of a prompt whose ground truth's character codes sum to an even number (a
    group whose samples agree: dynamic sampling drops it), else :func:`text_hash` (samples differ)."""
    return 0.0 if sum(map(ord, ground_truth)) % 2 == 0 else text_hash(completion)
