"""DAPO's group filter, by hand."""

from __future__ import annotations

import pytest

from verl_core.algorithms.dynamic_sampling import FILTER_METRICS, filter_groups


def test_groups_whose_samples_agree_are_dropped() -> None:
    # group 7: scores 1, 1 → agree (std 0), dropped; group 3: 0.5, 1 → differ, kept;
    # group 9: 0, 0, 0 → agree, dropped; group 4: 0, 0.25, 0 → differ, kept
    groups = [7, 7, 3, 3, 9, 9, 9, 4, 4, 4]
    scores = [1.0, 1.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0]
    f = filter_groups(groups, scores, capacity=10)
    assert f.kept == [False, False, True, True, False, False, False, True, True, True]
    assert (f.informative_groups, f.kept_groups, f.uniform_groups) == (2, 2, 2)


def test_capacity_keeps_the_first_informative_groups_in_row_order() -> None:
    # informative groups in order of first appearance: 5, 2, 8; capacity 2 → 5 and 2; 8 is surplus
    groups = [5, 5, 1, 1, 2, 2, 8, 8]
    values = [0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    f = filter_groups(groups, values, capacity=2)
    assert f.kept == [True, True, False, False, True, True, False, False]
    assert (f.informative_groups, f.kept_groups, f.uniform_groups) == (3, 2, 1)
    assert filter_groups(groups, values, capacity=0).kept == [False] * 8


def test_metric_choice_acc_and_score_decide_differently() -> None:
    # one group, two samples: scores 0.5 and 0.8, both below the correct threshold (both incorrect).
    # score: 0.5 ≠ 0.8 → informative; acc: 0.0 = 0.0 → agree, dropped
    assert FILTER_METRICS == {"acc": "correct", "score": "score"}  # verl's names → rewards columns
    assert filter_groups([0, 0], [0.5, 0.8], capacity=1).kept == [True, True]  # score
    assert filter_groups([0, 0], [float(False), float(False)], capacity=1).kept == [False, False]  # acc


def test_a_group_of_one_sample_is_kept_and_bad_input_is_refused() -> None:
    assert filter_groups([0], [1.0], capacity=1).kept == [True]  # nothing to compare: verl keeps it
    with pytest.raises(ValueError, match="2 group ids for 1 values"):
        filter_groups([0, 0], [1.0], capacity=1)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        filter_groups([0], [1.0], capacity=-1)
