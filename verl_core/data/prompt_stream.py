"""The prompt stream: the order an RL run takes its training prompts in, and the cursor that says
where the next generation batch starts.

Position k = 0, 1, 2, … of the stream over ``n`` prompts is row ``perm_e[k mod n]`` of the prompt
table, with epoch e = k // n and ``perm_e`` a permutation of range(n) seeded by (seed, e)
(``torch.randperm`` on a generator seeded ``derive_seed("prompt_order", seed, e)``; the identity
without shuffle). Batches are taken in order across epoch boundaries, so a batch may hold the end of
one epoch and the start of the next, and a batch larger than ``n`` holds some prompts twice.

The cursor is a position in the stream. Every iteration takes one batch of B prompts, from cursor
``iteration·B`` (:func:`iteration_cursor`), so the same iteration always sees the same prompts; DAPO
dynamic sampling takes a varying number of batches per iteration, each from where the last ended
(:func:`next_cursor`), and the cursor is kept in checkpoints so a resumed run continues it. Pure:
no store, no process state; the caller holds the cursor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from verl_core.errors import DataError
from verl_core.seeding import derive_seed


class StreamBatch(NamedTuple):
    """A batch of the prompt stream: the prompt table's rows in stream order (``rows[i]`` is position
    ``cursor + i``), the epoch of the first (``cursor // n``), and the cursor after the batch."""

    rows: list[int]
    epoch: int
    next_cursor: int


def stream_rows(
    n_prompts: int, cursor: int, count: int, *, seed: int, shuffle: bool
) -> tuple[list[int], int]:
    """``count`` rows of the stream over ``n_prompts`` prompts from position ``cursor``, and the epoch
    of the first: position k is ``perm_e[k mod n]`` with e = k // n (the module docstring). Raises
    DataError for an empty prompt set."""
    if n_prompts == 0:
        raise DataError("the prompt set is empty")
    rows: list[int] = []
    perms: dict[int, list[int]] = {}
    for k in range(cursor, cursor + count):
        epoch, pos = divmod(k, n_prompts)
        if epoch not in perms:  # one permutation per epoch the batch touches, drawn in epoch order
            g = torch.Generator().manual_seed(derive_seed("prompt_order", seed, epoch))
            perms[epoch] = (
                torch.randperm(n_prompts, generator=g).tolist() if shuffle else list(range(n_prompts))
            )
        rows.append(perms[epoch][pos])
    return rows, cursor // n_prompts


def next_cursor(cursor: int, batch_size: int) -> int:
    """The cursor after a batch of ``batch_size`` prompts taken from ``cursor``: cursor + B."""
    return cursor + batch_size


def iteration_cursor(iteration: int, batch_size: int) -> int:
    """Where iteration ``iteration``'s batch starts when every iteration takes one batch of
    ``batch_size``: iteration·B (so iteration i + 1 starts at the cursor after iteration i)."""
    return iteration * batch_size


def take_batch(n_prompts: int, cursor: int, batch_size: int, *, seed: int, shuffle: bool) -> StreamBatch:
    """The batch of ``batch_size`` prompts from ``cursor`` (:func:`stream_rows`) and the cursor after it
    (:func:`next_cursor`)."""
    rows, epoch = stream_rows(n_prompts, cursor, batch_size, seed=seed, shuffle=shuffle)
    return StreamBatch(rows, epoch, next_cursor(cursor, batch_size))


def iteration_batch(
    n_prompts: int, batch_size: int, iteration: int, *, seed: int, shuffle: bool
) -> StreamBatch:
    """Iteration ``iteration``'s batch when every iteration takes one: the batch from
    :func:`iteration_cursor`."""
    return take_batch(
        n_prompts, iteration_cursor(iteration, batch_size), batch_size, seed=seed, shuffle=shuffle
    )
