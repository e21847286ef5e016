"""DAPO dynamic sampling: keep only the prompt groups whose samples disagree (Yu et al. 2025, "DAPO",
§3.2 "Dynamic Sampling").

A group whose samples all got the same metric value (all correct, all wrong, equal scores) has a
group-relative advantage of zero for every sample (A_i = (r_i − mean(r)) / std(r) with every r_i equal),
so it spends a share of the update on no gradient. The sampler oversamples and keeps the first
``capacity`` informative groups, in row order; the rest (uniform ones and the surplus) are dropped.

Plain values in, a frozen result out; the metric values are chosen by the stage (a score, or 1.0/0.0
for correct/incorrect: verl's ``acc``), registered by name in :data:`FILTER_METRICS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

# verl's names (algorithm.filter_groups.metric): the column of the rewards table each one reads
FILTER_METRICS = {"acc": "correct", "score": "score"}


class GroupFilter(NamedTuple):
    """Which rows of a scored generation batch train, and why the others do not."""

    kept: list[bool]  # (S,) per row: its group is informative and within capacity
    informative_groups: int  # groups whose samples disagree (kept or surplus)
    kept_groups: int  # informative groups kept: min(informative, capacity)
    uniform_groups: int  # groups dropped because every sample got the same value


def filter_groups(group_ids: Sequence[int], values: Sequence[float], capacity: int) -> GroupFilter:
    """Mark the rows of the first ``capacity`` groups (in order of first appearance) whose values are
    not all equal; a group of one sample counts as informative (nothing to compare, as verl keeps it).

    Args:
        group_ids: ``(S,)`` the prompt group of each row.
        values: ``(S,)`` the filter metric of each row (a score; correct as 1.0 / 0.0).
        capacity: informative groups still wanted (≥ 0); later informative groups are surplus.
    """
    if len(group_ids) != len(values):
        raise ValueError(f"{len(group_ids)} group ids for {len(values)} values")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    by_group: dict[int, list[float]] = {}
    for g, v in zip(group_ids, values, strict=True):
        by_group.setdefault(g, []).append(float(v))
    # informative: max ≠ min over the group's samples (std > 0), or a single sample
    informative = [g for g, vs in by_group.items() if len(vs) == 1 or max(vs) != min(vs)]
    keep = set(informative[:capacity])
    return GroupFilter(
        kept=[g in keep for g in group_ids],
        informative_groups=len(informative),
        kept_groups=len(keep),
        uniform_groups=len(by_group) - len(informative),
    )
