"""The SQL of the rollout browser's sample tables (DuckDB): the query making a set's table from
its Parquet files, the WHERE / ORDER BY of a :class:`~browse.queries.SampleFilter` and a sort, and
the small conversions of results (Arrow, sample ids, per-token lists).
User text only ever reaches DuckDB as a parameter; column names are checked against a fixed list."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from browse.sets import SampleSet

# -------------------------------------------------------------------------------------------- SQL
_PROMPT_TEXT = (
    "array_to_string(list_transform(list_filter(prompt, lambda m: m.role <> 'system'), "
    "lambda m: m.content), '\\n\\n')"
)


# Columns of Catalog.samples / Catalog.group (one row per sample)
SAMPLE_COLUMNS = (
    "sample_id",  # "{group_id}:{sample_index}"
    "group_id",  # the prompt's position in the iteration's batch (its GRPO group)
    "sample_index",  # the sample's index in its group (ReMax's greedy baseline: rollout.n)
    "prompt_id",  # the prompt row's index in its prompt set (the same prompt across iterations)
    "data_source",
    "prompt",  # the user's text, without the chat template
    "response",
    "reward",  # the reward stage's score
    "correct",
    "advantage",  # mean over the response tokens (null: no update stage, e.g. val/eval)
    "response_length",
    "truncated",  # finish_reason == "length"
    "tool_calls",  # number of tool calls (multi-turn), 0 otherwise
    "policy_version",
    "extracted_answer",
    "ground_truth",
    "garbled",
    "garbled_reason",  # "" when not garbled (browse.garbled)
    "is_baseline",
    "finish_reason",
)
# A column of the sets' tables that no query returns (``SELECT * EXCLUDE``): every turn's text of a
# multi-turn sample (the model's and the tools' outputs) joined by newlines, null for a single-turn
# sample (its response is the whole text); the text filter searches it
SEARCH_COLUMN = "search_text"
# Columns of Catalog.tokens (one row per response token)
TOKEN_COLUMNS = (
    "position",
    "token_id",
    "token",  # the token's text (the run's tokenizer)
    "advantage",  # null without an update stage
    "kl",  # null when the update stored no KL (no KL in the reward)
    "behaviour_logprob",  # the rollout engine's
    "trainer_logprob",  # the trainer's recomputed pi_old (null when the update did not store it)
    "mismatch",  # behaviour_logprob - trainer_logprob
    "model_token",  # False on tool-output tokens (multi-turn)
)


@dataclass(frozen=True)
class SampleFilter:
    """Filters of :meth:`Catalog.samples`; None: no filter on that column. ``text``: a
    case-insensitive substring of the prompt or the response, or of any turn of a multi-turn
    response (tool outputs too; matched literally)."""

    data_source: str | None = None
    correct: bool | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    length_min: int | None = None
    length_max: int | None = None
    truncated: bool | None = None
    has_tool_calls: bool | None = None
    policy_version: int | None = None
    text: str | None = None
    garbled: bool | None = None


def set_query(s: SampleSet) -> tuple[str, list[Any]]:
    """The SELECT making a set's table (:data:`SAMPLE_COLUMNS`), and its parameters. The advantage
    is left null (:class:`browse.derived.Derived` fills in the update's means); no ORDER BY: every
    query of the table sorts."""
    params: list[Any] = [s.rollouts, s.rewards]
    prompt, joins = "r.prompt_text", ""
    if s.prompts is not None:
        prompt = "coalesce(p.text, r.prompt_text)"
        joins += f""" LEFT JOIN (SELECT index, any_value({_PROMPT_TEXT}) AS text FROM read_parquet(?)
                                 GROUP BY index) p ON p.index = r.prompt_index"""
        params.append(s.prompts)
    sql = f"""
        SELECT r.group_id::VARCHAR || ':' || r.sample_index::VARCHAR AS sample_id,
               r.group_id, r.sample_index, r.prompt_index AS prompt_id, r.data_source,
               {prompt} AS prompt, r.response_text AS response,
               w.score::DOUBLE AS reward, w.correct, NULL::DOUBLE AS advantage, r.response_length,
               r.finish_reason = 'length' AS truncated,
               coalesce(list_sum(list_transform(r.turns, lambda t: coalesce(len(t.calls), 0))), 0)::INTEGER
                   AS tool_calls,
               r.policy_version, w.extracted_answer, r.ground_truth,
               NULL::BOOLEAN AS garbled, NULL::VARCHAR AS garbled_reason,
               r.is_baseline, r.finish_reason,
               CASE WHEN len(r.turns) > 0
                    THEN array_to_string(list_transform(r.turns, lambda t: t.text), chr(10)) END
                   AS {SEARCH_COLUMN}
        FROM read_parquet(?) r JOIN read_parquet(?) w USING (group_id, sample_index){joins}"""
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
        add(
            f"(regexp_matches(response, ?) OR regexp_matches(prompt, ?)"
            f" OR coalesce(regexp_matches({SEARCH_COLUMN}, ?), false))",
            pattern,
            pattern,
            pattern,
        )
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


def mismatch_stats(behaviour: list[float] | None, trainer: list[float] | None) -> tuple[float, float, int]:
    """The readable reference of ``Catalog.top_mismatch``'s statistics for one sample
    (:func:`browse.derived.mismatch_arrays` vectorises it): max and mean of
    |behaviour - trainer| over the positions both lists hold, and the first position of the max;
    ``(nan, nan, -1)`` when there are none. NaN counts as the largest difference (DuckDB's order)."""
    diffs = [abs(float(b) - float(t)) for b, t in zip(behaviour or [], trainer or [], strict=False)]
    if not diffs:
        return float("nan"), float("nan"), -1
    nan = [i for i, d in enumerate(diffs) if d != d]
    top = nan[0] if nan else max(range(len(diffs)), key=lambda i: (diffs[i], -i))
    return diffs[top], sum(diffs) / len(diffs), top


def arrow_of(result: Any) -> pa.Table:
    """A DuckDB result as an Arrow table (duckdb 1.x ``fetch_arrow_table``, 2.x ``to_arrow_table``)."""
    fetch = getattr(result, "fetch_arrow_table", None) or result.to_arrow_table
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 2.x: "an extra copy of the rows"
        table: pa.Table = fetch()
    return table


def parse_sample_id(sample_id: str) -> tuple[int, int]:
    try:
        group_id, index = str(sample_id).split(":")
        return int(group_id), int(index)
    except ValueError:
        raise ValueError(f"sample id {sample_id!r}: expected 'GROUP:INDEX', e.g. '3:1'") from None


def padded(values: Any, n: int) -> np.ndarray | None:
    """``values`` as ``(n,)`` float64 (NaN where missing), None for a null or empty list."""
    if values is None or len(values) == 0:
        return None
    out = np.full(n, np.nan)
    got = np.asarray(values[:n], dtype=np.float64)
    out[: len(got)] = got
    return out
