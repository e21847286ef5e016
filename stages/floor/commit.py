"""The SPMD stage pattern, once, so stage bodies carry no rank logic.

A stage that runs on every rank of an SPMD job (the SFT stage, and the rollout, update and validation
stages of the RL loop) follows four steps; in one process each is the plain thing:

1. **skip**: the main rank decides whether the stage is committed, every rank gets its answer
   (:func:`committed`);
2. **compute**: every rank computes (its shard, or the whole batch through collectives);
3. **commit**: the main rank alone writes the artifacts and commits them (:func:`commit_once`);
4. **result**: every rank returns what the main rank committed (the manifest URI, or a value read
   from it); a failure on the main rank is raised on every rank, so nobody waits for a URI that will
   not come.

    stage = store.open_stage(...)
    if committed(stage):
        return stage.manifest_uri
    result = compute(...)                       # every rank
    return commit_once(lambda: write(stage, result))   # main rank writes, every rank gets the URI

Which ranks compute is the stage's business only through collectives inside ``compute``; a stage body
never asks which rank it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from verl_core.runtime.ranks import broadcast_from_main, on_main
from verl_core.store import StageWriter

T = TypeVar("T")


def committed(stage: StageWriter) -> bool:
    """Whether ``stage`` is committed, as the main rank sees it, on every rank (one process: its own
    answer). Every rank must call it: a broadcast in an SPMD job."""
    return bool(broadcast_from_main(stage.done))


def commit_once(write: Callable[[], T]) -> T:
    """Run ``write`` (write the artifacts, commit, log) on the main rank only and return its result on
    every rank; if it raises there, every rank raises (:func:`verl_core.runtime.ranks.on_main`). Every
    rank must call it."""
    return on_main(write)


def main_value(value: T) -> T:
    """The main rank's ``value`` on every rank (a decision or a number read on the main rank, e.g. a
    committed stage's summary). Every rank must call it."""
    return broadcast_from_main(value)
