"""A sample set's table in the rollout browser's in-memory DuckDB database, and what is derived
from its rows once per set in the background: the garbled flags (:mod:`browse.garbled`) and the
per-sample log-prob mismatch statistics that :meth:`browse.queries.Catalog.top_mismatch` ranks.

Making the table (the first page of a set waits for it): DuckDB reads the rollouts and rewards
(texts, scalars; the token lists left out) while a second thread reads the update's per-token
advantages with pyarrow and averages them with numpy (DuckDB reads a file of one row group on one
thread; the averages were half of the time as one query), then the means go into the table.

The jobs start as soon as the table is made, each on its own background thread (the garbled pass
uses a thread per core; the mismatch statistics one: beside it they finish sooner than after it,
and the garbled filter's page does not wait for the pass, below), so the first garbled filter
or largest-mismatch list finds them ready, or waits only for the remainder; a page shown before the
flags are ready gets its rows' flags computed on the fly, and so does the samples grid's first
garbled filter: its page is flagged in the page's order until full, its count shown once the pass
is done (:meth:`browse.queries.Catalog.samples`' ``count_later``). Committed files never change: everything
is kept for the catalog's life, keyed, like the table, by the set's rollouts file (a committed
attempt's path).

Mismatch statistics per sample, over the positions both log-prob lists hold (the readable reference
is :func:`browse.sql.mismatch_stats`): ``d = |behaviour - trainer|`` in float64, max (NaN counts as
the largest, as DuckDB orders it), mean, and the first position of the max; vectorised with numpy
over the flattened lists in chunks of ``CHUNK_ROWS`` samples.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from browse.garbled import garbled_reasons
from browse.sets import SampleSet
from browse.sql import SEARCH_COLUMN, arrow_of, set_query

CHUNK_ROWS = 8192  # samples per chunk of the mismatch pass (bounds its temporary arrays)
EARLY_BLOCK = 512  # rows first flagged for a garbled filter's page before the background's (doubling)
EARLY_ROWS = 8192  # rows flagged at most for it (~0.1 s of the pass), then it waits for the pass


def mismatch_arrays(
    behaviour: pa.Array | pa.ChunkedArray, trainer: pa.Array | pa.ChunkedArray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of two aligned list columns (``(rows,)`` lists of floats, nulls allowed): max and mean
    of ``|behaviour - trainer|`` over the first ``min(len)`` positions and the first position of the
    max; NaN, NaN, -1 for a row with no common position. Returns three ``(rows,)`` arrays."""
    b, t = (_combined(a) for a in (behaviour, trainer))
    rows = len(b)
    mx, mean, arg = np.full(rows, np.nan), np.full(rows, np.nan), np.full(rows, -1, np.int64)
    for lo in range(0, rows, CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS, rows)
        mx[lo:hi], mean[lo:hi], arg[lo:hi] = _chunk_stats(b.slice(lo, hi - lo), t.slice(lo, hi - lo))
    return mx, mean, arg


def _combined(a: pa.Array | pa.ChunkedArray) -> pa.ListArray:
    return a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a


def _flat(a: pa.ListArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``a``'s values as float64 (contiguous: slicing and null rows taken care of), each row's
    start in them and its length (0 for a null row)."""
    lengths = pc.fill_null(pc.list_value_length(a), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    values = a.flatten().to_numpy(zero_copy_only=False).astype(np.float64)
    return values, starts, lengths


def _chunk_stats(b: pa.ListArray, t: pa.ListArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    bv, bs, bl = _flat(b)
    tv, ts, tl = _flat(t)
    m = np.minimum(bl, tl)  # common positions per row
    rows, total = len(m), int(m.sum())
    mx, mean, arg = np.full(rows, np.nan), np.full(rows, np.nan), np.full(rows, -1, np.int64)
    if total == 0:
        return mx, mean, arg
    first = np.concatenate([[0], np.cumsum(m)[:-1]])  # each row's first d
    with np.errstate(invalid="ignore"):  # -inf - -inf: NaN, kept
        if np.array_equal(bl, tl):  # the usual case: both lists of a sample have its length
            d = np.abs(bv - tv)
        else:  # the common prefix of each row
            row = np.repeat(np.arange(rows), m)
            pos = np.arange(total) - first[row]
            d = np.abs(bv[bs[row] + pos] - tv[ts[row] + pos])
    has = m > 0
    at = first[has]  # reduceat over the non-empty rows only (an empty row would take the next one's)
    top = np.maximum.reduceat(d, at)  # NaN propagates: a NaN difference is the max
    mx[has] = top
    mean[has] = np.add.reduceat(d, at) / m[has]
    top_of = np.repeat(top, m[has])
    hits = np.flatnonzero((d == top_of) | (np.isnan(d) & np.isnan(top_of)))  # >= 1 in every row
    arg[has] = hits[np.searchsorted(hits, at)] - at  # each row's first hit
    return mx, mean, arg


def mismatch_table(rollouts: str, update: str, filesystem: Any = None) -> pa.Table:
    """The per-sample mismatch statistics of one set: group_id, sample_index, max_abs_mismatch,
    mean_abs_mismatch, argmax_position (-1: no common position), one row per sample of the
    rollouts file, the update's trainer log-probs (``old_log_probs``) matched by key."""
    keys = ["group_id", "sample_index"]
    streamed = _streamed_stats(rollouts, update, filesystem)
    if streamed is not None:
        return streamed
    r = _read(rollouts, [*keys, "logprobs"], filesystem)
    u = _read(update, [*keys, "old_log_probs"], filesystem)
    if not (r.select(keys).equals(u.select(keys))):  # not written in the same order: match by key
        r = r.append_column("_r", pa.array(np.arange(r.num_rows)))
        u = u.append_column("_u", pa.array(np.arange(u.num_rows)))
        joined = r.select([*keys, "_r"]).join(u.select([*keys, "_u"]), keys, join_type="left outer")
        joined = joined.sort_by("_r")
        trainer = u["old_log_probs"].take(joined["_u"])  # a null index: a null list
        r = r.drop_columns(["_r"])
    else:
        trainer = u["old_log_probs"]
    mx, mean, arg = mismatch_arrays(r["logprobs"], trainer)
    return (
        r.select(keys)
        .append_column("max_abs_mismatch", pa.array(mx))
        .append_column("mean_abs_mismatch", pa.array(mean))
        .append_column("argmax_position", pa.array(arg))
    )


class Derived:
    """The sample set tables of one catalog's in-memory database ``db`` and their background jobs:
    per table, its garbled flags filled in place and its mismatch statistics as ``{table}_mismatch``.
    ``filesystem``: what pyarrow reads ``s3://`` paths through (the store's fsspec filesystem);
    None for local paths."""

    def __init__(self, db: duckdb.DuckDBPyConnection, filesystem: Any = None) -> None:
        self._db = db
        self._fs = filesystem
        self._reader = ThreadPoolExecutor(1, "browse-open")  # the update's advantages, beside the table
        self._pool = ThreadPoolExecutor(1, "browse-garbled")  # the garbled flags, set after set
        self._mismatch_pool = ThreadPoolExecutor(1, "browse-mismatch")  # beside them: one thread
        self._garbled: dict[str, Future[None]] = {}
        self._mismatch: dict[str, Future[str]] = {}

    def create(self, table: str, s: SampleSet) -> None:
        """Make ``table`` from the set's files and queue its jobs (once per table; the caller holds
        the catalog's lock). The advantage means are computed (pyarrow, numpy) while DuckDB reads
        the rollouts and rewards, then written into the table's advantage column."""
        means = self._reader.submit(advantage_means, s.update, self._fs) if s.update else None
        cur = self._db.cursor()
        sql, params = set_query(s)
        cur.execute(f"CREATE TABLE {table} AS {sql}", params)
        if means is not None:
            cur.register("advantage_means", means.result())
            cur.execute(
                f"""UPDATE {table} t SET advantage = a.advantage FROM advantage_means a
                    WHERE t.group_id = a.group_id AND t.sample_index = a.sample_index"""
            )
            cur.unregister("advantage_means")
        self._garbled[table] = self._pool.submit(self._fill_garbled, table)
        if s.update is not None and _has_column(cur, s.update, "old_log_probs"):
            job = self._mismatch_pool.submit(self._fill_mismatch, table, s.rollouts, s.update)
            self._mismatch[table] = job

    def garbled_ready(self, table: str) -> bool:
        job = self._garbled.get(table)
        return job is not None and job.done() and job.exception() is None

    def wait_garbled(self, table: str) -> None:
        """Block until ``table``'s garbled columns are filled (raises the job's error)."""
        self._garbled[table].result()

    def mismatch(self, table: str) -> str | None:
        """The name of ``table``'s mismatch table once filled (blocks until then); None when its set
        has no trainer log-probs."""
        job = self._mismatch.get(table)
        return job.result() if job is not None else None

    def _fill_garbled(self, table: str) -> None:
        cur = self._db.cursor()
        rows = arrow_of(cur.execute(f"SELECT group_id, sample_index, response, truncated FROM {table}"))
        reasons = garbled_reasons(rows["response"], rows["truncated"].to_pylist())
        flags = rows.select(["group_id", "sample_index"]).append_column("reason", pa.array(reasons))
        cur.register("garbled_flags", flags)
        cur.execute(  # only the two columns rewritten, not the texts
            f"""UPDATE {table} t SET garbled = g.reason <> '', garbled_reason = g.reason
                FROM garbled_flags g
                WHERE t.group_id = g.group_id AND t.sample_index = g.sample_index"""
        )
        cur.unregister("garbled_flags")

    def _fill_mismatch(self, table: str, rollouts: str, update: str) -> str:
        name = f"{table}_mismatch"
        stats = mismatch_table(rollouts, update, self._fs)
        cur = self._db.cursor()
        cur.register("mismatch_stats", stats)
        cur.execute(f"CREATE TABLE {name} AS SELECT * FROM mismatch_stats")
        cur.unregister("mismatch_stats")
        return name


def advantage_means(update: str, filesystem: Any = None) -> pa.Table:
    """group_id, sample_index and the mean of each sample's per-token advantages (float64; null
    for a null or empty list) of an update file, read in batches of ``CHUNK_ROWS`` samples on one
    thread (DuckDB has the others; small batches reuse their memory: a first read of the whole
    column cost a second more in page faults)."""
    if filesystem is None:
        return _means(pq.ParquetFile(update))
    with filesystem.open(update, "rb") as f:
        return _means(pq.ParquetFile(f))


def _means(pf: pq.ParquetFile) -> pa.Table:
    keys = ["group_id", "sample_index"]
    parts = [pa.table({"group_id": pa.array([], pa.int64()), "sample_index": pa.array([], pa.int32())})]
    means, empty = [np.zeros(0)], [np.zeros(0, bool)]
    for batch in pf.iter_batches(batch_size=CHUNK_ROWS, columns=[*keys, "advantages"], use_threads=False):
        adv = batch.column("advantages")
        lengths = pc.fill_null(pc.list_value_length(adv), 0).to_numpy(zero_copy_only=False)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        has = lengths > 0
        sums = np.zeros(len(lengths))
        if has.any():  # each non-empty row's values run from its start to the next one's
            values = adv.flatten().to_numpy(zero_copy_only=False)  # float32, summed in float64
            sums[has] = np.add.reduceat(values, starts[has], dtype=np.float64)
        means.append(sums / np.maximum(lengths, 1))
        empty.append(~has)
        parts.append(pa.Table.from_batches([batch.select(keys)]))
    table = pa.concat_tables(parts, promote_options="permissive")
    return table.append_column("advantage", pa.array(np.concatenate(means), mask=np.concatenate(empty)))


def _streamed_stats(rollouts: str, update: str, filesystem: Any) -> pa.Table | None:
    """:func:`mismatch_table` over both files read in lockstep batches of ``CHUNK_ROWS`` samples
    (memory reused: reading both columns whole cost about a second more in page faults); None
    when a pair of batches does not hold the same samples (then the files are read whole)."""
    keys = ["group_id", "sample_index"]
    with ExitStack() as stack:
        files = [
            pq.ParquetFile(path if filesystem is None else stack.enter_context(filesystem.open(path, "rb")))
            for path in (rollouts, update)
        ]
        if files[0].metadata.num_rows != files[1].metadata.num_rows:
            return None
        batches = [
            f.iter_batches(batch_size=CHUNK_ROWS, columns=[*keys, col], use_threads=False)
            for f, col in zip(files, ("logprobs", "old_log_probs"), strict=True)
        ]
        parts = []
        for r, u in zip(*batches, strict=True):
            if not r.select(keys).equals(u.select(keys)):
                return None
            mx, mean, arg = _chunk_stats(r.column("logprobs"), u.column("old_log_probs"))
            stats = {"max_abs_mismatch": mx, "mean_abs_mismatch": mean, "argmax_position": arg}
            part = pa.Table.from_batches([r.select(keys)])
            for name, values in stats.items():
                part = part.append_column(name, pa.array(values))
            parts.append(part)
    return pa.concat_tables(parts) if parts else None


def _read(path: str, columns: list[str], filesystem: Any, use_threads: bool = True) -> pa.Table:
    """Columns of a Parquet file (``pq.ParquetFile``: no dataset discovery, whose first use imports
    ``pyarrow.dataset``), local or through ``filesystem`` (fsspec)."""
    if filesystem is None:
        return pq.ParquetFile(path).read(columns=columns, use_threads=use_threads)
    with filesystem.open(path, "rb") as f:
        return pq.ParquetFile(f).read(columns=columns, use_threads=use_threads)


def _has_column(cur: duckdb.DuckDBPyConnection, path: str, column: str) -> bool:
    names = cur.execute("SELECT name FROM parquet_schema(?)", [path]).fetchall()
    return (column,) in names


def early_garbled_page(
    cur: duckdb.DuckDBPyConnection,
    table: str,
    others: tuple[str, list[Any]],
    order: str,
    garbled: bool,
    offset: int,
    limit: int,
) -> tuple[pd.DataFrame, int | None] | None:
    """A garbled filter's page before the background flags are in: the rows of ``table`` matching
    the other filters (``others``: a WHERE clause and its parameters), in the page's ``order``,
    flagged here by :func:`browse.garbled.garbled_reasons` (what the background pass runs)
    ``EARLY_BLOCK`` rows, then twice as many at a time, until rows ``offset .. offset + limit`` of
    those whose flag is ``garbled`` are found; and their count when those rows were all of them (else
    None). None when ``EARLY_ROWS`` rows do not fill the page (few flagged: the caller waits for the
    pass)."""
    where, params = others
    found: list[tuple[int, int, str]] = []
    start, size = 0, EARLY_BLOCK
    while True:
        if start >= EARLY_ROWS:
            return None
        block = arrow_of(
            cur.execute(
                f"""SELECT group_id, sample_index, response, truncated FROM {table} WHERE {where}
                    ORDER BY {order} LIMIT ? OFFSET ?""",
                [*params, size, start],
            )
        )
        reasons = garbled_reasons(block["response"], block["truncated"].to_pylist())
        keys = zip(block["group_id"].to_pylist(), block["sample_index"].to_pylist(), strict=True)
        found += [(g, i, r) for (g, i), r in zip(keys, reasons, strict=True) if bool(r) == garbled]
        if block.num_rows < size or len(found) >= offset + limit:
            break
        start, size = start + size, 2 * size
    total = len(found) if block.num_rows < size else None  # every matching row seen
    chosen = found[offset : offset + limit]
    cur.register(
        "early_page",
        pa.table(
            {
                "group_id": pa.array([g for g, _, _ in chosen], pa.int64()),
                "sample_index": pa.array([i for _, i, _ in chosen], pa.int32()),
                "_rank": pa.array(range(len(chosen)), pa.int64()),
            }
        ),
    )
    page = cur.execute(
        f"""SELECT t.* EXCLUDE ({SEARCH_COLUMN}) FROM early_page k
            JOIN {table} t USING (group_id, sample_index) ORDER BY k._rank"""
    ).df()
    cur.unregister("early_page")
    page["garbled_reason"] = [r for _, _, r in chosen]
    page["garbled"] = [bool(r) for _, _, r in chosen]
    return page, total
