"""browse.sql: the mismatch statistics on hand-made log-probs (the SQL against the reference), the
text filter's escaping, and the sort column check."""

from __future__ import annotations

import math

import duckdb
import pyarrow as pa
import pytest

from browse.queries import SAMPLE_COLUMNS, SampleFilter
from browse.sql import MISMATCH_SQL, mismatch_stats, order_clause, where_clause

F = pa.list_(pa.float32())


def _sql_stats(behaviour: list[list[float] | None], trainer: list[list[float] | None]) -> list[tuple]:
    """Catalog.top_mismatch's per-sample SQL (MISMATCH_SQL, list_max/avg/position) over hand-made lists."""
    rows = pa.table({"i": list(range(len(behaviour))), "logprobs": pa.array(behaviour, F)})
    upd = pa.table({"i": list(range(len(trainer))), "old_log_probs": pa.array(trainer, F)})
    db = duckdb.connect()
    db.register("r_", rows)
    db.register("u_", upd)
    got = db.execute(
        f"""SELECT list_max(d), list_avg(d), list_position(d, list_max(d)) - 1, coalesce(len(d), 0)
            FROM (SELECT r.i, {MISMATCH_SQL} AS d FROM r_ r JOIN u_ u USING (i)) ORDER BY i"""
    ).fetchall()
    return [(mx, mean, arg) if n else (math.nan, math.nan, -1) for mx, mean, arg, n in got]


def test_mismatch_reference_on_hand_made_log_probs() -> None:
    # |diff| = 0, 0.5, 0.5 -> max 0.5 first at position 1, mean 1/3
    assert mismatch_stats([-1.0, -2.0, -3.0], [-1.0, -2.5, -2.5]) == (0.5, 1 / 3, 1)
    assert mismatch_stats([-1.0, -2.0], [-1.5]) == (0.5, 0.5, 0)  # the common prefix only
    mx, mean, arg = mismatch_stats(None, [-1.0])  # no behaviour values
    assert math.isnan(mx) and math.isnan(mean) and arg == -1
    mx, _, arg = mismatch_stats([-1.0, -math.inf, -2.0], [-1.5, -math.inf, -9.0])  # -inf - -inf: NaN
    assert math.isnan(mx) and arg == 1


def test_mismatch_sql_equals_the_reference() -> None:
    behaviour = [
        [-1.0, -2.0, -3.0],
        [-0.5],
        [-1.0, -2.0],
        [-1.0],
        None,
        [],
        [-1.0, -math.inf, -2.0],
        [-0.25, -4.0],
    ]
    trainer = [
        [-1.0, -2.5, -2.5],
        [-0.25],
        [-1.5],
        [-1.0, -9.0],
        [-1.0],
        [-1.0],
        [-1.5, -math.inf, -9.0],
        [-0.5, -4.25],
    ]
    want = [mismatch_stats(b, t) for b, t in zip(behaviour, trainer, strict=True)]
    got = _sql_stats(behaviour, trainer)
    for (gm, gmean, garg), (wm, wmean, warg) in zip(got, want, strict=True):
        assert garg == warg
        assert (math.isnan(gm) and math.isnan(wm)) or gm == pytest.approx(wm)
        assert (math.isnan(gmean) and math.isnan(wmean)) or gmean == pytest.approx(wmean)


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
