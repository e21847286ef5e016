"""browse.sql: the mismatch statistics' readable reference on hand-made log-probs (the vectorised
pass is checked against it in test_derived.py), the text filter's escaping and its search of
every turn of a multi-turn response, and the sort column check."""

from __future__ import annotations

import math
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from browse.queries import SAMPLE_COLUMNS, SampleFilter
from browse.sets import SampleSet
from browse.sql import SEARCH_COLUMN, mismatch_stats, order_clause, set_query, where_clause
from verl_core.store.schemas import get_schema


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
    assert where == (
        "correct = ? AND (regexp_matches(response, ?) OR regexp_matches(prompt, ?)"
        " OR coalesce(regexp_matches(search_text, ?), false))"
    )
    assert params == [False, *[r"(?i)a\.b\ \(x\)"] * 3]
    assert where_clause(SampleFilter()) == ("TRUE", [])


def test_sort_columns_come_from_the_list_only() -> None:
    assert order_clause([("reward", False)], SAMPLE_COLUMNS) == (
        '"reward" DESC NULLS LAST, group_id, sample_index'
    )
    with pytest.raises(ValueError, match="cannot sort by"):
        order_clause([('reward" DESC; --', True)], SAMPLE_COLUMNS)


def test_text_filter_searches_every_turn_of_a_multi_turn_sample(tmp_path: Path) -> None:
    # sample 0:0 has turns: model "compute 6*7", tool output "42", model "the answer is 42" (its
    # response_text, the last model turn); sample 0:1 is single-turn (no turns)
    call = {"name": "calc", "arguments": "6*7", "result": "42", "error": None, "latency_s": 0.0}
    turns = [
        [
            {"role": "assistant", "text": "compute 6*7", "ids": [1], "calls": []},
            {"role": "tool", "text": "RESULT 42", "ids": [2], "calls": [call]},
            {"role": "assistant", "text": "the answer is 42", "ids": [3], "calls": []},
        ],
        None,
    ]
    rollouts = pa.table(
        {
            "group_id": pa.array([0, 0], pa.int64()),
            "sample_index": pa.array([0, 1], pa.int32()),
            "prompt_index": pa.array([0, 0], pa.int64()),
            "data_source": ["calc", "calc"],
            "prompt_text": ["what is 6*7?", "what is 6*7?"],
            "response_text": ["the answer is 42", "compute it: 42"],
            "response_length": pa.array([3, 3], pa.int32()),
            "finish_reason": ["stop", "stop"],
            "turns": pa.array(turns, get_schema("rollouts").field("turns").type),
            "policy_version": pa.array([0, 0], pa.int64()),
            "ground_truth": ["42", "42"],
            "is_baseline": [False, False],
        }
    )
    rewards = pa.table(
        {
            "group_id": pa.array([0, 0], pa.int64()),
            "sample_index": pa.array([0, 1], pa.int32()),
            "score": pa.array([1.0, 1.0], pa.float32()),
            "correct": [True, True],
            "extracted_answer": ["42", "42"],
        }
    )
    pq.write_table(rollouts, tmp_path / "rollouts.parquet")
    pq.write_table(rewards, tmp_path / "rewards.parquet")
    s = SampleSet(
        "train",
        "iter-0000",
        0,
        "rollout",
        2,
        *(str(tmp_path / f) for f in ("rollouts.parquet", "rewards.parquet")),
        None,
        None,
        None,
    )
    db = duckdb.connect()
    sql, params = set_query(s)
    db.execute(f"CREATE TABLE t AS {sql}", params)

    def found(text: str) -> list[str]:
        where, values = where_clause(SampleFilter(text=text))
        return [
            r[0]
            for r in db.execute(
                f"SELECT sample_id FROM t WHERE {where} ORDER BY sample_id", values
            ).fetchall()
        ]

    assert found("result 42") == ["0:0"]  # the tool's output, only in the turns
    assert found("COMPUTE") == ["0:0", "0:1"]  # a first model turn / a single-turn response
    assert found("answer is") == ["0:0"]  # the last turn: the response
    assert found("6*7?") == ["0:0", "0:1"]  # the prompt
    assert found("nowhere") == []
    stored = db.execute(f"SELECT {SEARCH_COLUMN} FROM t ORDER BY sample_id").fetchall()
    assert stored == [("compute 6*7\nRESULT 42\nthe answer is 42",), (None,)]  # single-turn: null
    assert SEARCH_COLUMN not in SAMPLE_COLUMNS  # hidden: the queries exclude it
