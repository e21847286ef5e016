"""Data parallelism in SPMD: every rank holds the whole batch and works on its share of it.

The rule that keeps FSDP2 / ZeRO-3 collectives matched: a forward all-gathers parameters, so every
rank must run the same number of forward (and backward) calls per optimizer step and per no-grad
pass. Every rank holds the whole batch, so each can compute *every* rank's micro-batch plan
(Karmarkar–Karp split of the rows over the data-parallel ranks, then token-budget micro-batches per
rank) and take the largest count; a rank with fewer runs padding micro-batches: one short real
sequence whose loss is multiplied by 0 (so it adds exactly zero gradient).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import Tensor

from verl_core.data.packing import dynamic_micro_batches, karmarkar_karp

__all__ = [
    "DPView",
    "MicroBatch",
    "dp_micro_batches",
    "dp_split",
    "dp_view",
    "micro_batches",
    "sum_over_ranks",
]


class DPView(NamedTuple):
    """This process's place among the data-parallel ranks (``group`` None: one process)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None


class MicroBatch(NamedTuple):
    """Sample rows of one micro-batch and the weight of its loss: 1.0, or 0.0 for a padding
    micro-batch (a real sequence run only so that this rank makes the same collective calls)."""

    rows: list[int]
    weight: float


def dp_view(engine: Any) -> DPView:
    """The data-parallel view of a training engine: its strategy's (or, for DeepSpeed, its own)
    ``dp_rank``, ``dp_size``, ``dp_group``. A strategy without them (no tensor parallelism) is data
    parallel over all its ranks: the default group when there is more than one."""
    src = getattr(engine, "strategy", engine)
    if hasattr(src, "dp_size"):
        return DPView(int(src.dp_rank), int(src.dp_size), src.dp_group)
    size = int(src.world_size)
    if size == 1:
        return DPView(0, 1, None)
    return DPView(dist.get_rank(), size, dist.group.WORLD)


def micro_batches(
    rows: Sequence[int],
    lengths: Sequence[int],
    budget: int,
    fixed: int | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """Micro-batches (lists of sample rows) of ``rows``: ``fixed`` samples each, or balanced
    token-budget ones (verl's ``use_dynamic_bsz``; a sample longer than ``budget`` gets its own).

    With ``prompts`` (each row's prompt ids; shared-prompt forwards) the budget counts the tokens a
    forward computes: rows with the same prompt are kept together, a unit costing ``P + Σ R`` (the
    prompt once), split into consecutive rows only where one unit is over the budget."""
    if not rows:
        return []
    if fixed is not None:
        return [list(rows[i : i + fixed]) for i in range(0, len(rows), fixed)]
    units: list[list[int]] = [[r] for r in rows]
    costs = [lengths[r] for r in rows]
    if prompts is not None:
        units, costs = _prompt_units(rows, lengths, budget, prompts)
    parts = dynamic_micro_batches(costs, max(budget, max(costs)))
    return [[r for i in p for r in units[i]] for p in parts]


def _prompt_units(
    rows: Sequence[int], lengths: Sequence[int], budget: int, prompts: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[int]]:
    """``rows`` grouped by prompt (first-appearance order), each group cut into runs of rows whose
    ``P + Σ R`` fits ``budget`` (a row alone may exceed it); ``(units, their costs)``."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for r in rows:
        by_prompt.setdefault(tuple(prompts[r]), []).append(r)
    units: list[list[int]] = []
    costs: list[int] = []
    for prompt, members in by_prompt.items():
        p = len(prompt)
        for r in members:
            response = lengths[r] - p
            if units and units[-1][0] in members and costs[-1] + response <= budget:
                units[-1].append(r)
                costs[-1] += response
            else:
                units.append([r])
                costs.append(p + response)
    return units, costs


def dp_split(rows: Sequence[int], lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """``rows`` split over ``dp_size`` ranks, part r for rank r: Karmarkar–Karp on the lengths (equal
    row counts when they divide evenly); a part is empty when there are fewer rows than ranks."""
    if dp_size == 1:
        return [list(rows)]
    parts = karmarkar_karp([lengths[r] for r in rows], dp_size, equal_size=len(rows) % dp_size == 0)
    return [[rows[i] for i in p] for p in parts]


def dp_micro_batches(
    rows: Sequence[int],
    lengths: Sequence[int],
    budget: int,
    dp: DPView,
    fixed: int | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
) -> list[MicroBatch]:
    """This rank's micro-batches of ``rows`` (the same ``rows`` on every rank), padded to the count
    of the rank with the most: the padding micro-batch is the shortest row of ``rows``, weight 0.
    ``prompts``: see :func:`micro_batches` (within each rank's share)."""
    parts = dp_split(rows, lengths, dp.size)
    plans = [micro_batches(part, lengths, budget, fixed, prompts) for part in parts]
    count = max(len(p) for p in plans)  # what every rank runs
    mine = plans[dp.rank]
    pad = min(rows, key=lambda r: (lengths[r], r))
    return [MicroBatch(m, 1.0) for m in mine] + [MicroBatch([pad], 0.0)] * (count - len(mine))


def sum_over_ranks(t: Tensor, dp: DPView) -> Tensor:
    """``t`` summed over the data-parallel ranks, in place (a no-op in one process).

    Used as an all-gather of row shards: each rank fills its own rows of a zero tensor, and
    x + 0 = x exactly in floating point, so the sum is every rank's rows bit for bit."""
    if dp.group is not None:
        dist.all_reduce(t, group=dp.group)
    return t
