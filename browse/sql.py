"""The SQL of the rollout browser's sample tables (DuckDB): the query making a set's table from
its Parquet files, and the WHERE / ORDER BY of a :class:`~browse.queries.SampleFilter` and a sort.
User text only ever reaches DuckDB as a parameter; column names are checked against a fixed list."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from browse.sets import SampleSet

if TYPE_CHECKING:
    from browse.queries import SampleFilter

# -------------------------------------------------------------------------------------------- SQL
_PROMPT_TEXT = (
    "array_to_string(list_transform(list_filter(prompt, lambda m: m.role <> 'system'), "
    "lambda m: m.content), '\\n\\n')"
)


def set_query(s: SampleSet) -> tuple[str, list[Any]]:
    """The SELECT making a set's table (:data:`SAMPLE_COLUMNS`), and its parameters."""
    params: list[Any] = [s.rollouts, s.rewards]
    adv, joins = "NULL::DOUBLE", ""
    if s.update is not None:
        adv = "u.advantage"
        joins += """ LEFT JOIN (SELECT group_id, sample_index, list_avg(advantages)::DOUBLE AS advantage
                                FROM read_parquet(?)) u USING (group_id, sample_index)"""
        params.append(s.update)
    prompt = "r.prompt_text"
    if s.prompts is not None:
        prompt = "coalesce(p.text, r.prompt_text)"
        joins += f""" LEFT JOIN (SELECT index, any_value({_PROMPT_TEXT}) AS text FROM read_parquet(?)
                                 GROUP BY index) p ON p.index = r.prompt_index"""
        params.append(s.prompts)
    sql = f"""
        SELECT r.group_id::VARCHAR || ':' || r.sample_index::VARCHAR AS sample_id,
               r.group_id, r.sample_index, r.prompt_index AS prompt_id, r.data_source,
               {prompt} AS prompt, r.response_text AS response,
               w.score::DOUBLE AS reward, w.correct, {adv} AS advantage, r.response_length,
               r.finish_reason = 'length' AS truncated,
               coalesce(list_sum(list_transform(r.turns, lambda t: coalesce(len(t.calls), 0))), 0)::INTEGER
                   AS tool_calls,
               r.policy_version, w.extracted_answer, r.ground_truth,
               NULL::BOOLEAN AS garbled, NULL::VARCHAR AS garbled_reason,
               r.is_baseline, r.finish_reason
        FROM read_parquet(?) r JOIN read_parquet(?) w USING (group_id, sample_index){joins}
        ORDER BY r.group_id, r.sample_index"""
    return sql, params


def where_clause(f: SampleFilter) -> tuple[str, list[Any]]:
    """The WHERE clause of ``f`` with ``?`` placeholders, and their values (user text is only ever
    a parameter)."""
    conds: list[str] = []
    params: list[Any] = []

    def add(cond: str, *values: Any) -> None:
        conds.append(cond)
        params.extend(values)

    if f.data_source is not None:
        add("data_source = ?", f.data_source)
    if f.correct is not None:
        add("correct = ?", f.correct)
    if f.reward_min is not None:
        add("reward >= ?", float(f.reward_min))
    if f.reward_max is not None:
        add("reward <= ?", float(f.reward_max))
    if f.length_min is not None:
        add("response_length >= ?", int(f.length_min))
    if f.length_max is not None:
        add("response_length <= ?", int(f.length_max))
    if f.truncated is not None:
        add("truncated = ?", f.truncated)
    if f.has_tool_calls is not None:
        add("(tool_calls > 0) = ?", f.has_tool_calls)
    if f.policy_version is not None:
        add("policy_version = ?", int(f.policy_version))
    if f.text:  # case-insensitive literal: RE2 with the text escaped (no lower() copy of every text)
        pattern = "(?i)" + re.escape(f.text)
        add("(regexp_matches(response, ?) OR regexp_matches(prompt, ?))", pattern, pattern)
    if f.garbled is not None:
        add("garbled = ?", f.garbled)
    return (" AND ".join(conds) or "TRUE"), params


def order_clause(sort: list[tuple[str, bool]], columns: tuple[str, ...]) -> str:
    """ORDER BY of ``sort`` (columns checked against ``columns``), then group and index."""
    parts = []
    for col, ascending in sort:
        if col not in columns:
            raise ValueError(f"cannot sort by {col!r}: not one of {', '.join(columns)}")
        parts.append(f'"{col}" {"ASC" if ascending else "DESC"} NULLS LAST')
    return ", ".join([*parts, "group_id", "sample_index"])


def mismatch_stats(
    behaviour: pa.ChunkedArray, trainer: pa.ChunkedArray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of two list columns of log-probs: max and mean of |behaviour - trainer| over the
    positions both hold, and the position of the max; ``(rows,)`` each, NaN / -1 for a row with
    none. Vectorised over rows of equal lengths (every row the pipeline writes); others one by one."""
    a, t = behaviour.combine_chunks(), trainer.combine_chunks()
    la = pc.list_value_length(a).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    lt = pc.list_value_length(t).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    rows = len(la)
    mx, mean, arg = np.full(rows, np.nan), np.full(rows, np.nan), np.full(rows, -1, np.int64)
    av = pc.list_flatten(a).to_numpy(zero_copy_only=False).astype(np.float64)
    tv = pc.list_flatten(t).to_numpy(zero_copy_only=False).astype(np.float64)
    sa, st = np.concatenate([[0], np.cumsum(la)]), np.concatenate([[0], np.cumsum(lt)])
    if ((la == lt) & (la > 0)).all():  # one array of |differences|, reduced per row
        diff, starts = np.abs(av - tv), sa[:-1]
        if np.isfinite(diff).all():
            mx = np.maximum.reduceat(diff, starts)
            mean = np.add.reduceat(diff, starts) / la
            idx = np.flatnonzero(diff == np.repeat(mx, la))  # the first index of each row's max
            return mx, mean, idx[np.searchsorted(idx, starts)] - starts
    for i in range(rows):
        n = int(min(la[i], lt[i]))
        if n:
            d = np.abs(av[sa[i] : sa[i] + n] - tv[st[i] : st[i] + n])
            j = int(np.argmax(d))
            mx[i], mean[i], arg[i] = d[j], float(d.mean()), j
    return mx, mean, arg
