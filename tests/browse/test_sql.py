"""browse.sql: the mismatch statistics on hand-made log-probs (both paths), the text filter's
escaping, and the sort column check."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from browse.queries import SAMPLE_COLUMNS, SampleFilter
from browse.sql import mismatch_stats, order_clause, where_clause

F = pa.list_(pa.float32())


def test_mismatch_stats_equal_lengths() -> None:
    a = pa.chunked_array([pa.array([[-1.0, -2.0, -3.0], [-0.5]], F)])
    t = pa.chunked_array([pa.array([[-1.0, -2.5, -2.5], [-0.25]], F)])
    mx, mean, arg = mismatch_stats(a, t)
    # row 0: |diff| = 0, 0.5, 0.5 -> max 0.5 first at position 1, mean 1/3; row 1: 0.25 at 0
    assert mx.tolist() == [0.5, 0.25] and arg.tolist() == [1, 0]
    assert mean == pytest.approx([1 / 3, 0.25])


def test_mismatch_stats_unequal_lengths_use_the_common_prefix() -> None:
    a = pa.chunked_array([pa.array([[-1.0, -2.0], [-1.0], None], F)])
    t = pa.chunked_array([pa.array([[-1.5], [-1.0, -9.0], [-1.0]], F)])
    mx, mean, arg = mismatch_stats(a, t)
    # row 0: one common position, |diff| 0.5; row 1: 0 at position 0; row 2: no behaviour values
    assert mx[:2].tolist() == [0.5, 0.0] and np.isnan(mx[2]) and arg.tolist() == [0, 0, -1]
    assert mean[:2].tolist() == [0.5, 0.0] and np.isnan(mean[2])


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
