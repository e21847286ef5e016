"""Old vs new rewards of the same rollouts (``verl-flow rescore``): per-row differences, a summary and
the rows where the two disagree most. Pure functions over plain values; row i of every argument is
the same sample.

Correctness flags are compared as a confusion of (old, new):

    TT  both correct        TF  correct before, wrong now
    FT  wrong before, correct now        FF  wrong in both

    agreement = (TT + FF) / rows          accuracy_old = (TT + TF) / rows      accuracy_new = (TT + FT) / rows
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple


class Confusion(NamedTuple):
    """Counts of (old, new) correctness flags; see the module docstring."""

    tt: int
    tf: int
    ft: int
    ff: int


class RowComparison(NamedTuple):
    """B rows, old vs new: the scores (B,), the correct flags (B,) and ``abs_diff`` = |new - old| (B,)."""

    score_old: list[float]
    score_new: list[float]
    correct_old: list[bool]
    correct_new: list[bool]
    abs_diff: list[float]


class RewardComparison(NamedTuple):
    """Summary of old vs new rewards of ``rows`` samples (NaN means and rates when ``rows`` is 0)."""

    rows: int
    score_old_mean: float
    score_new_mean: float
    accuracy_old: float
    accuracy_new: float
    agreement: float  # fraction of rows whose correct flags agree
    confusion: Confusion
    scores_changed: int  # rows whose score changed (|new - old| > 0)


def _rate(count: float, rows: int) -> float:
    return count / rows if rows else math.nan


def compare_rewards(
    score_old: Sequence[float],
    score_new: Sequence[float],
    correct_old: Sequence[bool],
    correct_new: Sequence[bool],
) -> tuple[RowComparison, RewardComparison]:
    """The per-row comparison and the summary of two scorings of the same B rows (all arguments (B,))."""
    n = len(score_old)
    if not len(score_new) == len(correct_old) == len(correct_new) == n:
        raise ValueError(
            f"old and new rewards must have the same rows: scores {n} vs {len(score_new)}, "
            f"flags {len(correct_old)} vs {len(correct_new)}"
        )
    rows = RowComparison(
        [float(s) for s in score_old],
        [float(s) for s in score_new],
        [bool(c) for c in correct_old],
        [bool(c) for c in correct_new],
        [abs(float(new) - float(old)) for old, new in zip(score_old, score_new, strict=True)],
    )
    pairs = list(zip(rows.correct_old, rows.correct_new, strict=True))
    confusion = Confusion(
        tt=pairs.count((True, True)),
        tf=pairs.count((True, False)),
        ft=pairs.count((False, True)),
        ff=pairs.count((False, False)),
    )
    summary = RewardComparison(
        rows=n,
        score_old_mean=_rate(sum(rows.score_old), n),
        score_new_mean=_rate(sum(rows.score_new), n),
        accuracy_old=_rate(confusion.tt + confusion.tf, n),
        accuracy_new=_rate(confusion.tt + confusion.ft, n),
        agreement=_rate(confusion.tt + confusion.ff, n),
        confusion=confusion,
        scores_changed=sum(d > 0 for d in rows.abs_diff),
    )
    return rows, summary


def combine_comparisons(parts: Sequence[RewardComparison]) -> RewardComparison:
    """The summary of the union of the rows of ``parts`` (e.g. an iteration's generation batches):
    counts add, means are weighted by rows."""
    n = sum(p.rows for p in parts)

    def weighted(field: str) -> float:
        return _rate(sum(getattr(p, field) * p.rows for p in parts if p.rows), n)

    confusion = Confusion(*(sum(p.confusion[i] for p in parts) for i in range(4)))
    return RewardComparison(
        rows=n,
        score_old_mean=weighted("score_old_mean"),
        score_new_mean=weighted("score_new_mean"),
        accuracy_old=_rate(confusion.tt + confusion.tf, n),
        accuracy_new=_rate(confusion.tt + confusion.ft, n),
        agreement=_rate(confusion.tt + confusion.ff, n),
        confusion=confusion,
        scores_changed=sum(p.scores_changed for p in parts),
    )


def most_disagreeing(rows: RowComparison, k: int) -> list[int]:
    """Indices of at most ``k`` rows where old and new disagree most: a flipped correct flag first,
    then the larger |new - old|, then the lower index; rows with the same flag and score are left out."""
    flipped = [o != n for o, n in zip(rows.correct_old, rows.correct_new, strict=True)]
    differ = [i for i, (f, d) in enumerate(zip(flipped, rows.abs_diff, strict=True)) if f or d > 0]
    return sorted(differ, key=lambda i: (not flipped[i], -rows.abs_diff[i], i))[:k]
