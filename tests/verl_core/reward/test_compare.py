"""Old vs new rewards (verl_core.reward.compare): expected values worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest

from verl_core.reward.compare import (
    Confusion,
    RewardComparison,
    combine_comparisons,
    compare_rewards,
    most_disagreeing,
)

# five rows:        0     1     2     3     4
OLD_SCORE = [1.0, 0.0, 0.0, 0.5, 1.0]
NEW_SCORE = [1.0, 1.0, 0.0, 0.25, 0.0]
OLD_CORRECT = [True, False, False, False, True]
NEW_CORRECT = [True, True, False, False, False]


def test_compare_rewards_by_hand() -> None:
    rows, s = compare_rewards(OLD_SCORE, NEW_SCORE, OLD_CORRECT, NEW_CORRECT)
    # |new - old| = 0, 1, 0, 0.25, 1
    assert rows.abs_diff == [0.0, 1.0, 0.0, 0.25, 1.0]
    assert rows.score_old == OLD_SCORE and rows.correct_new == NEW_CORRECT
    # (old, new) flags: row 0 TT, row 1 FT, rows 2-3 FF, row 4 TF
    assert s.confusion == Confusion(tt=1, tf=1, ft=1, ff=2)
    assert s.rows == 5
    assert s.score_old_mean == pytest.approx(2.5 / 5)  # 1 + 0 + 0 + 0.5 + 1
    assert s.score_new_mean == pytest.approx(2.25 / 5)  # 1 + 1 + 0 + 0.25 + 0
    assert s.accuracy_old == pytest.approx(2 / 5)  # TT + TF
    assert s.accuracy_new == pytest.approx(2 / 5)  # TT + FT
    assert s.agreement == pytest.approx(3 / 5)  # TT + FF
    assert s.scores_changed == 3  # rows 1, 3, 4


def test_identical_rewards_agree_everywhere() -> None:
    rows, s = compare_rewards(OLD_SCORE, OLD_SCORE, OLD_CORRECT, OLD_CORRECT)
    assert s.agreement == 1.0 and s.scores_changed == 0
    assert s.confusion == Confusion(tt=2, tf=0, ft=0, ff=3)
    assert most_disagreeing(rows, 10) == []


def test_most_disagreeing_puts_flipped_flags_first() -> None:
    rows, _ = compare_rewards(OLD_SCORE, NEW_SCORE, OLD_CORRECT, NEW_CORRECT)
    # flipped: rows 1 and 4 (|diff| 1 each: by index), then row 3 (same flag, |diff| 0.25); 0 and 2 agree
    assert most_disagreeing(rows, 10) == [1, 4, 3]
    assert most_disagreeing(rows, 2) == [1, 4]
    # a flipped flag with no score change still outranks a score change without a flip
    rows, _ = compare_rewards([0.0, 0.0], [0.9, 0.0], [False, False], [False, True])
    assert most_disagreeing(rows, 2) == [1, 0]


def test_combine_weights_by_rows() -> None:
    _, a = compare_rewards(OLD_SCORE, NEW_SCORE, OLD_CORRECT, NEW_CORRECT)  # 5 rows
    _, b = compare_rewards([0.0], [1.0], [False], [True])  # 1 row, FT
    c = combine_comparisons([a, b])
    assert c.rows == 6
    assert c.confusion == Confusion(tt=1, tf=1, ft=2, ff=2)
    assert c.score_old_mean == pytest.approx(2.5 / 6)  # (2.5 + 0) / 6
    assert c.score_new_mean == pytest.approx(3.25 / 6)  # (2.25 + 1) / 6
    assert c.accuracy_old == pytest.approx(2 / 6) and c.accuracy_new == pytest.approx(3 / 6)
    assert c.agreement == pytest.approx(3 / 6) and c.scores_changed == 4
    assert combine_comparisons([a]) == a


def test_empty_and_mismatched() -> None:
    _, s = compare_rewards([], [], [], [])
    assert isinstance(s, RewardComparison) and s.rows == 0 and math.isnan(s.agreement)
    with pytest.raises(ValueError, match="same rows"):
        compare_rewards([1.0], [1.0, 0.0], [True], [True])
