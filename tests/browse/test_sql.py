"""browse.sql: the mismatch statistics' readable reference on hand-made log-probs (the vectorised
pass is checked against it in test_derived.py), the text filter's escaping, and the sort column
check."""

from __future__ import annotations

import math

import pytest

from browse.queries import SAMPLE_COLUMNS, SampleFilter
from browse.sql import mismatch_stats, order_clause, where_clause


def test_mismatch_reference_on_hand_made_log_probs() -> None:
    # |diff| = 0, 0.5, 0.5 -> max 0.5 first at position 1, mean 1/3
    assert mismatch_stats([-1.0, -2.0, -3.0], [-1.0, -2.5, -2.5]) == (0.5, 1 / 3, 1)
    assert mismatch_stats([-1.0, -2.0], [-1.5]) == (0.5, 0.5, 0)  # the common prefix only
    mx, mean, arg = mismatch_stats(None, [-1.0])  # no behaviour values
    assert math.isnan(mx) and math.isnan(mean) and arg == -1
    mx, _, arg = mismatch_stats([-1.0, -math.inf, -2.0], [-1.5, -math.inf, -9.0])  # -inf - -inf: NaN
    assert math.isnan(mx) and arg == 1


def test_text_filter_is_an_escaped_case_insensitive_pattern() -> None:
    where, params = where_clause(SampleFilter(text="a.b (x)", correct=False))
    assert where == "correct = ? AND (regexp_matches(response, ?) OR regexp_matches(prompt, ?))"
    assert params == [False, r"(?i)a\.b\ \(x\)", r"(?i)a\.b\ \(x\)"]
    assert where_clause(SampleFilter()) == ("TRUE", [])


def test_sort_columns_come_from_the_list_only() -> None:
    assert order_clause([("reward", False)], SAMPLE_COLUMNS) == (
        '"reward" DESC NULLS LAST, group_id, sample_index'
    )
    with pytest.raises(ValueError, match="cannot sort by"):
        order_clause([('reward" DESC; --', True)], SAMPLE_COLUMNS)
