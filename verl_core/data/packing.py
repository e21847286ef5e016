"""Sequence packing and token balancing: pure functions over sequence lengths and token ids.

* :func:`plan_bins` - token-budget bin packing (first-fit / best-fit decreasing): which sequences
  go together in one packed row of at most ``budget`` tokens.
* :func:`pack` / :func:`unpack` - sequences ↔ a :class:`PackedBatch` (flat ids without padding,
  per-sequence position ids, ``cu_seqlens``), the input of a padding-free ("rmpad") forward.
* :func:`dynamic_micro_batches` - verl's ``use_dynamic_bsz``: split a batch into micro-batches of at
  most ``max_token_len`` tokens each.
* :func:`balanced_partition` - verl's ``balance_batch``: split a batch into ``k`` parts of nearly
  equal token counts for data-parallel ranks: :func:`karmarkar_karp` (largest differencing method,
  Karmarkar & Karp 1982), or the LPT baseline :func:`greedy_partition` on the rare inputs where it
  is better; :func:`imbalance` = max part tokens / mean part tokens.

Index lists returned here refer to positions in the ``lengths`` argument. Only :func:`pack` needs
torch (imported when called).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

PACK_ALGORITHMS = ("ffd", "bfd")


class PackedBatch(NamedTuple):
    """S sequences concatenated into N tokens, no padding.

    input_ids     (N,)   int64   tokens of sequence 0, then sequence 1, ...
    position_ids  (N,)   int64   0..len-1 restarting at every sequence
    cu_seqlens    (S+1,) int32   sequence s is input_ids[cu_seqlens[s]:cu_seqlens[s+1]]
    seq_index     (S,)   int64   original row index of each sequence
    loss_mask     (N,)   int8    per-token loss mask, or None
    max_seqlen    int            longest sequence (flash-attn varlen wants it)
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_index: torch.Tensor
    loss_mask: torch.Tensor | None
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_index.shape[0])

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch on ``device``."""
        mask = None if self.loss_mask is None else self.loss_mask.to(device)
        return PackedBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.cu_seqlens.to(device),
            self.seq_index.to(device),
            mask,
            self.max_seqlen,
        )


def pack(
    sequences: Sequence[Sequence[int]],
    *,
    seq_index: Sequence[int] | None = None,
    loss_masks: Sequence[Sequence[int]] | None = None,
) -> PackedBatch:
    """Concatenate ``sequences`` (S lists of token ids) into a :class:`PackedBatch`.

    ``seq_index``: original row index per sequence (default 0..S-1); ``loss_masks``: per-token masks
    of the same lengths as the sequences."""
    import torch

    lengths = [len(s) for s in sequences]
    if loss_masks is not None:
        bad = [i for i, (s, m) in enumerate(zip(sequences, loss_masks, strict=True)) if len(s) != len(m)]
        if bad:
            raise ValueError(f"loss mask of sequence {bad[0]} has a different length than its ids")
    index = list(range(len(sequences))) if seq_index is None else list(seq_index)
    if len(index) != len(sequences):
        raise ValueError(f"seq_index has {len(index)} entries for {len(sequences)} sequences")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    flat = list(itertools.chain.from_iterable(sequences))
    # position ids restart at 0 for every sequence: arange(N) - start of the token's sequence
    starts = torch.repeat_interleave(cu[:-1].to(torch.int64), torch.tensor(lengths, dtype=torch.int64))
    positions = torch.arange(len(flat), dtype=torch.int64) - starts  # (N,)
    mask = None
    if loss_masks is not None:
        mask = torch.tensor(list(itertools.chain.from_iterable(loss_masks)), dtype=torch.int8)
    return PackedBatch(
        input_ids=torch.tensor(flat, dtype=torch.int64),
        position_ids=positions,
        cu_seqlens=cu,
        seq_index=torch.tensor(index, dtype=torch.int64),
        loss_mask=mask,
        max_seqlen=max(lengths, default=0),
    )


def unpack(batch: PackedBatch) -> list[list[int]]:
    """The token id lists of a :class:`PackedBatch`, in packed order (see ``batch.seq_index``)."""
    return [t.tolist() for t in split_packed(batch.input_ids, batch.cu_seqlens)]


def split_packed(values: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Per-sequence views of a packed per-token tensor ``values`` (N, ...) by ``cu_seqlens`` (S+1,)."""
    bounds = cu_seqlens.tolist()
    return [values[a:b] for a, b in itertools.pairwise(bounds)]


def restore_order(seq_index: Sequence[int], items: Sequence[object]) -> list[object]:
    """``items`` given in packed order (one per sequence) put back in original row order."""
    order = sorted(range(len(seq_index)), key=lambda i: seq_index[i])
    return [items[i] for i in order]


# --------------------------------------------------------------------------------------------------
# Bin packing


def plan_bins(lengths: Sequence[int], budget: int, algorithm: str = "bfd") -> list[list[int]]:
    """Group sequence positions into bins of at most ``budget`` tokens.

    Decreasing order (ties by position), then first-fit (``ffd``: the earliest bin with room) or
    best-fit (``bfd``: the bin with the least room that fits). Positions inside a bin are sorted.
    Raises ValueError naming the first sequence longer than ``budget``."""
    if algorithm not in PACK_ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; valid: {', '.join(PACK_ALGORITHMS)}")
    _check_fits(lengths, budget, "token budget")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    if algorithm == "ffd":
        for i in order:
            j = next((b for b, r in enumerate(room) if r >= lengths[i]), None)
            if j is None:
                bins.append([])
                room.append(budget)
                j = len(bins) - 1
            bins[j].append(i)
            room[j] -= lengths[i]
    else:
        by_room: list[tuple[int, int]] = []  # (room left, bin id), sorted
        for i in order:
            k = bisect.bisect_left(by_room, (lengths[i], -1))
            if k == len(by_room):
                bins.append([])
                j, left = len(bins) - 1, budget
            else:
                left, j = by_room.pop(k)
            bins[j].append(i)
            bisect.insort(by_room, (left - lengths[i], j))
    return [sorted(b) for b in bins]


def packing_waste(lengths: Sequence[int], bins: Sequence[Sequence[int]], budget: int) -> float:
    """Fraction of the ``len(bins) * budget`` token slots left empty."""
    slots = len(bins) * budget
    return 0.0 if slots == 0 else 1.0 - sum(lengths[i] for b in bins for i in b) / slots


def padded_waste(lengths: Sequence[int], batch_size: int) -> float:
    """Fraction of pad tokens when consecutive batches of ``batch_size`` sequences are each padded to
    their longest sequence (the baseline packing is compared with)."""
    slots = sum(
        max(lengths[a : a + batch_size]) * len(lengths[a : a + batch_size])
        for a in range(0, len(lengths), batch_size)
    )
    return 0.0 if slots == 0 else 1.0 - sum(lengths) / slots


# --------------------------------------------------------------------------------------------------
# Balancing


def karmarkar_karp(lengths: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Split positions into ``k`` parts of nearly equal total length (largest differencing method).

    Every item starts as a partial solution (k sets, one holding it); repeatedly the two partial
    solutions with the largest spread (max set - min set) are merged, pairing the largest set of
    one with the smallest of the other, until one remains. ``equal_size`` (len divisible by k):
    start from groups of k consecutive sorted items, one per set, so all parts get len/k items."""
    _check_k(lengths, k, equal_size)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    # a partial solution: list of k (total, items) sorted by total, descending
    states: list[list[tuple[int, list[int]]]] = []
    if equal_size:
        for a in range(0, len(order), k):
            states.append(sorted([(lengths[i], [i]) for i in order[a : a + k]], key=lambda s: -s[0]))
    else:
        states = [[(lengths[i], [i])] + [(0, []) for _ in range(k - 1)] for i in order]
    tie = itertools.count()
    heap = [(-(s[0][0] - s[-1][0]), next(tie), s) for s in states]
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # largest set of one with the smallest of the other: (k,) totals, sorted again below
        merged = [(first[j][0] + second[k - 1 - j][0], first[j][1] + second[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tie), merged))
    final = heap[0][2] if heap else [(0, []) for _ in range(k)]
    return sorted((sorted(items) for _, items in final), key=lambda p: p[0] if p else math.inf)


def greedy_partition(lengths: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Longest-first greedy (LPT): each item, longest first, goes to the lightest part (that still has
    room for ``len/k`` items when ``equal_size``)."""
    _check_k(lengths, k, equal_size)
    cap = len(lengths) // k if equal_size else len(lengths)
    parts: list[list[int]] = [[] for _ in range(k)]
    totals = [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = min((p for p in range(k) if len(parts[p]) < cap), key=lambda p: (totals[p], p))
        parts[j].append(i)
        totals[j] += lengths[i]
    return [sorted(p) for p in parts]


def balanced_partition(lengths: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """What to balance data-parallel ranks with: :func:`karmarkar_karp`, or :func:`greedy_partition`
    where that is better. Differencing is usually far better than greedy, but not always (e.g.
    lengths [5, 2, 2, 2, 1, 1], k=2, equal sizes: KK gives 8 | 5, greedy 7 | 6), so both are
    computed (O(n log n) each) and the lower :func:`imbalance` is kept: never worse than greedy."""
    kk = karmarkar_karp(lengths, k, equal_size=equal_size)
    greedy = greedy_partition(lengths, k, equal_size=equal_size)
    return greedy if imbalance(lengths, greedy) < imbalance(lengths, kk) else kk


def imbalance(lengths: Sequence[int], parts: Sequence[Sequence[int]]) -> float:
    """max part tokens / mean part tokens (1.0 = perfectly balanced)."""
    totals = [sum(lengths[i] for i in p) for p in parts]
    mean = sum(totals) / len(totals) if totals else 0.0
    return 1.0 if mean == 0 else max(totals) / mean


def dynamic_micro_batches(lengths: Sequence[int], max_token_len: int, *, min_num: int = 1) -> list[list[int]]:
    """verl's dynamic batch size: the fewest balanced micro-batches (at least ``min_num``) whose
    total length is each at most ``max_token_len``; micro-batches ordered by their first position.

    Starts from ceil(total / max_token_len) parts (Karmarkar-Karp) and adds one part while a part
    is over the limit. Raises ValueError when one sequence is longer than ``max_token_len``."""
    _check_fits(lengths, max_token_len, "max_token_len")
    if not lengths:
        return []
    num = max(min_num, math.ceil(sum(lengths) / max_token_len))
    while True:
        parts = [p for p in karmarkar_karp(lengths, min(num, len(lengths))) if p]
        if all(sum(lengths[i] for i in p) <= max_token_len for p in parts):
            return parts
        num += 1


def _check_fits(lengths: Sequence[int], budget: int, what: str) -> None:
    if budget <= 0:
        raise ValueError(f"{what} must be positive, got {budget}")
    for i, n in enumerate(lengths):
        if n > budget:
            raise ValueError(f"sequence {i} has {n} tokens, more than the {what} of {budget}")
        if n < 0:
            raise ValueError(f"sequence {i} has a negative length {n}")


def _check_k(lengths: Sequence[int], k: int, equal_size: bool) -> None:
    if k <= 0:
        raise ValueError(f"number of parts must be positive, got {k}")
    if equal_size and len(lengths) % k:
        raise ValueError(
            f"equal_size needs the number of sequences ({len(lengths)}) to be divisible by k={k}"
        )
