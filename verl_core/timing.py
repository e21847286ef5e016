"""Wall-clock timing of code blocks (stage phases, kernel phases)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def timed(into: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the ``with`` block takes to ``into[name]`` (created at 0.0), also when it raises:
    ``with timed(timing, "rollout"): ...``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into[name] = into.get(name, 0.0) + time.perf_counter() - t0
