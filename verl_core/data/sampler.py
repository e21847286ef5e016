"""Length-grouped sampling: batches of indices of similar length, batch order shuffled.

As the length-grouped samplers of HF ``transformers``/``megatron``: shuffle all indices (seeded by
``seed`` and the epoch), cut them into mega-batches of ``batch_size * group_size`` indices, sort
each mega-batch by length (longest first), cut it into batches, then shuffle the batch order. Rows
in one batch have similar lengths (little padding, balanced packed bins), while each epoch still
visits the data in a different random order.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from verl_core.seeding import derive_seed


class LengthGroupedSampler:
    """Yields lists of indices into ``lengths``; every index exactly once per epoch (the last,
    smaller batch is dropped when ``drop_last``). Deterministic for a given seed and epoch."""

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        seed: int,
        group_size: int = 50,
        drop_last: bool = False,
    ) -> None:
        if batch_size <= 0 or group_size <= 0:
            raise ValueError(f"batch_size and group_size must be positive, got {batch_size}, {group_size}")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.group_size = group_size
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order ``__iter__`` yields."""
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        rng = random.Random(derive_seed("length_grouped", self.seed, self.epoch))
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        mega = self.batch_size * self.group_size
        batches: list[list[int]] = []
        for a in range(0, len(order), mega):
            group = sorted(order[a : a + mega], key=lambda i: -self.lengths[i])
            batches.extend(group[b : b + self.batch_size] for b in range(0, len(group), self.batch_size))
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        rng.shuffle(batches)
        yield from batches
