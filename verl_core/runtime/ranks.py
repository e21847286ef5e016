"""Who does what in an SPMD job (the SFT stage or the RL loop under torchrun): every rank computes its
shard, the main rank alone decides (skip a committed stage or not), writes artifacts and reports.

The main rank is rank 0 unless the job says otherwise (:func:`set_main`): torchrun's c10d rendezvous
numbers nodes in an order of its own, so the worker that launched the job (node 0's first, which holds
the Prefect context and the job's result path) need not be global rank 0.

These are the few object collectives the stages need, over the default process group; in one process
(no process group) each is the identity, so a stage reads the same either way:

    decision = broadcast_from_main(stage.done if is_main() else None)   # one answer for every rank
    mine = generate(my_prompts)                                          # every rank its shard
    everything = gather_to_main(mine)                                    # rank 0: all, in rank order
    uri = on_main(lambda: commit(everything))                            # main writes, all get the URI

Objects travel with torch's object collectives (pickled in memory between the job's own ranks; nothing
is read back from storage this way).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from verl_core.errors import VerlFlowError

T = TypeVar("T")


class RankFailedError(VerlFlowError):
    """The main rank failed inside :func:`on_main`; raised on the other ranks with its message."""


_MAIN = 0


def set_main(main_rank: int) -> None:
    """Make ``main_rank`` the rank that decides, writes and reports (every rank must call it alike)."""
    global _MAIN
    _MAIN = main_rank


def main_rank() -> int:
    return _MAIN if distributed() else 0


def distributed() -> bool:
    """Whether this process is one rank of a multi-process job."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def local_rank() -> int:
    """This rank's index on its node (torchrun's ``LOCAL_RANK``; the global rank without it)."""
    return int(os.environ.get("LOCAL_RANK", rank())) if distributed() else 0


def local_world_size() -> int:
    """Processes on this node (torchrun's ``LOCAL_WORLD_SIZE``; the world size without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size())) if distributed() else 1


def is_main() -> bool:
    """The main rank (or the only process): the rank that commits artifacts and talks to Prefect and
    MLflow."""
    return rank() == main_rank()


def broadcast_from_main(value: T) -> T:
    """The main rank's ``value`` on every rank (the other ranks' ``value`` is ignored)."""
    if not distributed():
        return value
    box: list[Any] = [value if is_main() else None]
    dist.broadcast_object_list(box, src=main_rank())
    return box[0]


def gather_to_main(items: Sequence[T]) -> list[T] | None:
    """Every rank's ``items`` concatenated in rank order on the main rank; None on the others."""
    if not distributed():
        return list(items)
    out: list[list[T]] | None = [[] for _ in range(world_size())] if is_main() else None
    dist.gather_object(list(items), out, dst=main_rank())
    return [x for part in out for x in part] if out is not None else None


def all_gather(items: Sequence[T]) -> list[T]:
    """Every rank's ``items`` concatenated in rank order, on every rank."""
    if not distributed():
        return list(items)
    out: list[list[T]] = [[] for _ in range(world_size())]
    dist.all_gather_object(out, list(items))
    return [x for part in out for x in part]


def on_main(fn: Callable[[], T]) -> T:
    """Run ``fn`` on the main rank only and return its result on every rank. If it raises, the main
    rank re-raises and the others raise :class:`RankFailedError` with its message (nobody waits for a
    result that will not come)."""
    if not distributed():
        return fn()
    outcome: tuple[bool, Any] = (True, None)
    error: BaseException | None = None
    if is_main():
        try:
            outcome = (True, fn())
        except BaseException as err:  # every rank must leave the collective below
            error = err
            outcome = (False, f"{type(err).__name__}: {err}")
    ok, value = broadcast_from_main(outcome)
    if error is not None:
        raise error
    if not ok:
        raise RankFailedError(f"rank {main_rank()} failed: {value}")
    return value


def rank0_to_main(value: T) -> T | None:
    """``value`` of rank 0 on the main rank (None elsewhere): torch gathers full state dicts onto
    global rank 0, the main rank writes them."""
    if not distributed():
        return value
    main = main_rank()
    if main == 0:
        return value if rank() == 0 else None
    box: list[Any] = [value]
    if rank() == 0:
        dist.send_object_list(box, dst=main)
    elif rank() == main:
        dist.recv_object_list(box, src=0)
        return box[0]
    return None


def barrier() -> None:
    if distributed():
        dist.barrier()
