"""Queries of the rollout browser over a store's committed artifacts (read-only).

A :class:`Catalog` opens one store (a local path or ``s3://``) and answers everything the pages
show. It finds files only through committed manifests (:class:`verl_core.store.ArtifactStore`), so a
run still writing shows the stages it has committed and nothing half-written. Results are pandas
DataFrames.

Sample sets (``kind``, ``key``), as :meth:`Catalog.sample_sets` lists them:

    train   iter-0003            iter-0003/rollout + reward + update (dynamic sampling:
                                 iter-0003/gen-1 for generation batch 1, no update)
    val     iter-0003            iter-0003/val, greedy; iter-0003/sampled its sampled pass
    eval    export-iter-0002/greedy, export-iter-0002/sampled     eval/{label}

A sample's id is ``"{group_id}:{sample_index}"`` (unique within a set).
The columns (:data:`SAMPLE_COLUMNS`, :data:`TOKEN_COLUMNS`) and :class:`SampleFilter` are defined
in :mod:`browse.sql` and imported from here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from browse.decode import token_texts
from browse.derived import Derived, early_garbled_page
from browse.garbled import garbled_reasons
from browse.sets import SampleKind, SampleSet, list_sets
from browse.sql import (
    SAMPLE_COLUMNS,
    SEARCH_COLUMN,
    TOKEN_COLUMNS,
    SampleFilter,
    order_clause,
    padded,
    parse_sample_id,
    where_clause,
)
from stages.floor.locations import REPORT, rescore_report_stage
from stages.floor.parent import run_link
from stages.floor.reports import collect_series
from stages.floor.rescore import list_rescores
from verl_core.config import validate_config
from verl_core.config.loader import flatten_config
from verl_core.errors import ArtifactNotFoundError, VerlFlowError
from verl_core.store import ArtifactStore, Manifest

_ALL = f"* EXCLUDE ({SEARCH_COLUMN})"  # a set table's SAMPLE_COLUMNS (its hidden column left out)

__all__ = ["SAMPLE_COLUMNS", "TOKEN_COLUMNS", "Catalog", "SampleFilter", "SampleKind"]

MANIFEST_TTL_S = 5.0  # a run's manifests are listed again after this long (a run still writing)
# The iteration chart's names for the logged metrics (the first one a run has)
ITERATION_METRICS = {
    "reward_mean": ("critic/score/mean",),
    "accuracy": ("reward/accuracy",),
    "kl": ("critic/kl", "actor/kl_loss"),  # KL to the reference: in the reward, or as a loss
    "ppo_kl": ("actor/ppo_kl",),  # KL of the update to the rollout policy
    "response_length_mean": ("response_length/mean",),
    "clip_frac": ("actor/pg_clipfrac",),
    "truncated_frac": ("response_length/clip_ratio",),
    "val_accuracy": ("val/accuracy",),
}


class Catalog:
    """The runs of one store, read-only. ``run_ids``: only these runs (None: all of the store's).

    A sample set is read once from its Parquet files (the token lists left out) into a table of an
    in-memory DuckDB database, and every filter, sort and page is a query of that table; committed
    files never change, so the table is kept (keyed by the rollouts file). Its garbled flags and
    mismatch statistics are computed in the background once it is made (:mod:`browse.derived`).
    Thread-safe: each query runs on a cursor of its own."""

    def __init__(self, store_url: str, run_ids: list[str] | None = None) -> None:
        self.store = ArtifactStore(store_url)
        self.run_ids = list(run_ids) if run_ids else None
        self._db = duckdb.connect(":memory:")
        if not self.store.url.startswith("file://"):
            self._db.register_filesystem(self.store.fs)  # s3:// paths read through the store's fsspec
        self._lock = threading.Lock()
        self._tables: dict[str, str] = {}  # rollouts file → table name
        self._derived = Derived(self._db, None if self.store.url.startswith("file://") else self.store.fs)
        self._manifests: dict[str, tuple[float, list[Manifest]]] = {}
        self._tokenizers: dict[str, Any] = {}
        self._set_lists: dict[str, tuple[list[Manifest], list[SampleSet]]] = {}

    # ---------------------------------------------------------------------------------------- runs
    def runs(self) -> pd.DataFrame:
        """One row per run: run_id, experiment, status ("finished": report committed, else
        "running or stopped"), stages, config_hash, created, updated, parent, link_kind
        ("run" | "fork" | "replay"), parent_iteration, iterations, reward_mean, accuracy,
        val_accuracy (the last of each). The MLflow run and Prefect flow run a run recorded
        are read by the runs page (:func:`flows.run_links.read_links`, ``runs/RUN/links.json``)."""
        rows = []
        for run_id in self.run_ids or self.store.list_runs():
            try:
                rec = self.store.read_run_record(run_id)
                manifests = self.manifests(run_id)
            except VerlFlowError:
                continue
            link = run_link(run_id, rec.config)
            last = self.iterations(run_id)
            rows.append(
                {
                    "run_id": run_id,
                    "experiment": rec.config.get("trainer", {}).get("experiment_name", ""),
                    "status": "finished"
                    if any(m.stage == REPORT for m in manifests)
                    else "running or stopped",
                    "stages": len(manifests),
                    "config_hash": rec.config_hash,
                    "created": rec.created_at,
                    "updated": rec.updated_at,
                    "parent": link.parent,
                    "link_kind": link.kind,
                    "parent_iteration": link.iteration,
                    "iterations": len(last),
                    **{k: _last(last, k) for k in ("reward_mean", "accuracy", "val_accuracy")},
                }
            )
        return pd.DataFrame(rows)

    def run_config(self, run_id: str) -> dict[str, Any]:
        """The run's resolved config, flattened (``{"actor.lr": "6e-05", ...}``) with secrets
        redacted as the trackers log it (:func:`verl_core.config.loader.flatten_config`)."""
        return flatten_config(validate_config(self.store.read_run_record(run_id).config))

    def manifests(self, run_id: str) -> list[Manifest]:
        """The run's committed manifests (listed again after ``MANIFEST_TTL_S``)."""
        now = time.monotonic()
        cached = self._manifests.get(run_id)
        if cached is None or now - cached[0] > MANIFEST_TTL_S:
            cached = (now, self.store.list_manifests(run_id))
            self._manifests[run_id] = cached
        return cached[1]

    def iterations(self, run_id: str) -> pd.DataFrame:
        """One row per iteration: iteration, reward_mean, accuracy, kl, ppo_kl, response_length_mean,
        clip_frac, truncated_frac, val_accuracy (NaN where the run has none; names in
        ``ITERATION_METRICS``), then every per-iteration metric of the committed stages under its
        logged name."""
        series = collect_series(self.store, run_id)
        for m in self.manifests(run_id):  # the reward stage's own batch figures collect_series leaves out
            metrics = m.summary.get("metrics") if m.stage.endswith("/reward") else None
            if isinstance(metrics, dict) and "response_length/clip_ratio" in metrics:
                it = int(m.summary.get("iteration", -1))
                series.setdefault("response_length/clip_ratio", {})[it] = float(
                    metrics["response_length/clip_ratio"]
                )
        its = sorted({i for v in series.values() for i in v if i >= 0})
        frame: dict[str, Any] = {"iteration": its}
        for col, names in ITERATION_METRICS.items():
            name = next((n for n in names if n in series), None)
            frame[col] = [series[name].get(i, np.nan) if name else np.nan for i in its]
        for name in sorted(series):
            frame[name] = [series[name].get(i, np.nan) for i in its]
        return pd.DataFrame(frame)

    # ---------------------------------------------------------------------------------------- samples
    def sample_sets(self, run_id: str) -> pd.DataFrame:
        """The run's committed sample sets: kind, key, iteration (-1 for eval), stage, rows, uri
        (the rollouts file), has_update (advantages and trainer log-probs joined)."""
        sets = self._sets(run_id)
        cols = ["kind", "key", "iteration", "stage", "rows", "uri", "has_update"]
        return pd.DataFrame(
            [(s.kind, s.key, s.iteration, s.stage, s.rows, s.rollouts, s.update is not None) for s in sets],
            columns=cols,
        )

    def samples(
        self,
        run_id: str,
        kind: SampleKind,
        key: str,
        filters: SampleFilter | None = None,
        sort: list[tuple[str, bool]] | None = None,
        offset: int = 0,
        limit: int = 100,
        count_later: bool = False,
    ) -> tuple[pd.DataFrame, int | None]:
        """A page of the set's samples matching ``filters`` (:data:`SAMPLE_COLUMNS`), sorted by
        ``sort`` ((column, ascending) pairs; then by group_id, sample_index), and the number of
        matching samples. Raises ValueError for a sort column not in :data:`SAMPLE_COLUMNS`.

        A garbled filter waits for the set's background flags, unless ``count_later``: then a page
        within the first ``EARLY_ROWS`` matching the other filters is answered at once
        (:func:`browse.derived.early_garbled_page`) with the count None (not known yet: ask again without
        ``count_later`` for it)."""
        table = self._table(self._find(run_id, kind, key))
        f = filters or SampleFilter()
        order = order_clause(sort or [], SAMPLE_COLUMNS)
        if f.garbled is not None and not self._derived.garbled_ready(table):
            where, params = where_clause(replace(f, garbled=None))
            early = (
                early_garbled_page(self._db.cursor(), table, (where, params), order, f.garbled, offset, limit)
                if count_later
                else None
            )
            if early is not None:
                return early
            self._derived.wait_garbled(table)  # started when the table was made
        where, params = where_clause(f)
        keys = ", ".join(dict.fromkeys(["group_id", "sample_index", *(f'"{c}"' for c, _ in sort or [])]))
        cur = self._db.cursor()
        # one scan: the matching rows' keys and sort columns, then the page's whole rows by key
        page = cur.execute(
            f"""WITH m AS MATERIALIZED (SELECT {keys} FROM {table} WHERE {where}),
                     p AS (SELECT group_id, sample_index FROM m ORDER BY {order} LIMIT ? OFFSET ?)
                SELECT t.* EXCLUDE ({SEARCH_COLUMN}), (SELECT count(*) FROM m) AS _total
                FROM p JOIN {table} t USING (group_id, sample_index) ORDER BY {order}""",
            [*params, int(limit), int(offset)],
        ).df()
        if len(page):
            total = int(page.pop("_total").iloc[0])
        else:  # a page past the end
            page = page.drop(columns="_total")
            found = cur.execute(f"SELECT count(*) FROM {table} WHERE {where}", params).fetchone()
            total = int(found[0]) if found else 0
        return _with_garbled(page), total

    def group(self, run_id: str, kind: SampleKind, key: str, prompt_id: int) -> pd.DataFrame:
        """The samples of prompt ``prompt_id`` in the set (its group: the n responses), by
        sample_index (:data:`SAMPLE_COLUMNS`)."""
        table = self._table(self._find(run_id, kind, key))
        page = (
            self._db.cursor()
            .execute(
                f"SELECT {_ALL} FROM {table} WHERE prompt_id = ? ORDER BY group_id, sample_index",
                [prompt_id],
            )
            .df()
        )
        return _with_garbled(page)

    def prompt_history(self, run_id: str, prompt: int | str) -> pd.DataFrame:
        """The training samples of one prompt across the run's iterations: ``prompt`` is a prompt
        id of the train set (an int, or a text of digits) or a text the prompt contains (case
        ignored). Columns: iteration, then :data:`SAMPLE_COLUMNS`; by iteration, sample_index."""
        text = str(prompt).strip()
        params: list[Any]
        if text.isdigit():
            cond, params = "prompt_id = ?", [int(text)]
        else:
            cond, params = "contains(lower(prompt), ?)", [text.lower()]
        parts = []
        for s in self._sets(run_id):
            if s.kind != "train":
                continue
            table = self._table(s)
            sql = f"SELECT ? AS iteration, {_ALL} FROM {table} WHERE {cond} ORDER BY group_id, sample_index"
            parts.append(_with_garbled(self._db.cursor().execute(sql, [s.iteration, *params]).df()))
        parts = [p for p in parts if len(p)]
        if not parts:
            return pd.DataFrame(columns=["iteration", *SAMPLE_COLUMNS])
        return pd.concat(parts, ignore_index=True)

    # ---------------------------------------------------------------------------------------- tokens
    def tokens(self, run_id: str, kind: SampleKind, key: str, sample_id: str) -> pd.DataFrame:
        """Per response token of one sample (:data:`TOKEN_COLUMNS`). Raises ArtifactNotFoundError
        for a sample the set does not hold."""
        s = self._find(run_id, kind, key)
        group_id, index = parse_sample_id(sample_id)
        cur = self._db.cursor()
        row = cur.execute(
            "SELECT response_ids, logprobs, loss_mask FROM read_parquet(?) "
            "WHERE group_id = ? AND sample_index = ?",
            [s.rollouts, group_id, index],
        ).fetchone()
        if row is None:
            raise ArtifactNotFoundError(f"run {run_id!r}: {kind} {key} has no sample {sample_id!r}")
        ids: list[int] = list(row[0] or [])
        n = len(ids)
        adv = kl = trainer = None
        if s.update is not None:
            cols = "advantages, kl, " + ("old_log_probs" if self._has_trainer_logprobs(s) else "NULL")
            upd = cur.execute(
                f"SELECT {cols} FROM read_parquet(?) WHERE group_id = ? AND sample_index = ?",
                [s.update, group_id, index],
            ).fetchone()
            if upd is not None:
                adv, kl, trainer = (padded(v, n) for v in upd)
        behaviour = padded(row[1], n)
        mask = row[2]
        tok = self._tokenizer(s)
        texts = token_texts(tok, ids) if tok else [str(i) for i in ids]  # multi-byte characters whole
        frame = pd.DataFrame(
            {
                "position": np.arange(n),
                "token_id": ids,
                "token": texts,
                "advantage": adv if adv is not None else np.full(n, np.nan),
                "kl": kl if kl is not None else np.full(n, np.nan),
                "behaviour_logprob": behaviour,
                "trainer_logprob": trainer if trainer is not None else np.full(n, np.nan),
                "model_token": [True] * n if mask is None else [bool(m) for m in mask],
            }
        )
        frame.insert(7, "mismatch", frame["behaviour_logprob"] - frame["trainer_logprob"])
        return frame

    def top_mismatch(self, run_id: str, kind: SampleKind, key: str, limit: int = 20) -> pd.DataFrame:
        """The samples whose behaviour and trainer log-probs differ most over their model tokens:
        sample_id, prompt_id, reward, response_length, max_abs_mismatch, mean_abs_mismatch,
        argmax_position; empty when the set has no trainer log-probs (no update, or one written
        before they were stored)."""
        cols = [
            "sample_id", "prompt_id", "reward", "response_length",
            "max_abs_mismatch", "mean_abs_mismatch", "argmax_position",
        ]  # fmt: skip
        s = self._find(run_id, kind, key)
        table = self._table(s)
        stats = self._derived.mismatch(table)  # computed in the background since the table was made
        if stats is None:
            return pd.DataFrame(columns=cols)
        sql = f"""SELECT b.sample_id, b.prompt_id, b.reward, b.response_length, m.max_abs_mismatch,
                         m.mean_abs_mismatch, m.argmax_position
                  FROM {stats} m JOIN {table} b USING (group_id, sample_index)
                  WHERE m.argmax_position >= 0
                  ORDER BY isnan(m.max_abs_mismatch), m.max_abs_mismatch DESC, b.group_id, b.sample_index
                  LIMIT ?"""
        return self._db.cursor().execute(sql, [int(limit)]).df()[cols]

    # ---------------------------------------------------------------------------------------- rescores
    def rescores(self, run_id: str) -> list[str]:
        """Names of the run's rescores with a committed report."""
        return [r.name for r in list_rescores(self.manifests(run_id)) if r.report is not None]

    def rescore(self, run_id: str, name: str) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``(agreement, disagreements)`` of rescore ``name``: its ``comparison.parquet`` (one row
        per rescored table: source, split, iteration, rows, score/accuracy old and new, agreement,
        tt/tf/ft/ff, scores_changed) with a last row ``source == "all"`` (the report's total), and
        its ``disagreements.parquet`` (both verdicts: score_old/new, correct_old/new,
        extracted_old/new) with a sample_id column."""
        report = self.store.committed(run_id, rescore_report_stage(name))
        if report is None:
            raise ArtifactNotFoundError(f"run {run_id!r} has no committed rescore {name!r} report")
        agreement = self.store.read_table(report, "comparison.parquet").to_pandas()
        total = report.summary.get("total")
        if isinstance(total, dict):
            agreement = pd.concat([agreement, pd.DataFrame([total])], ignore_index=True)
        dis = self.store.read_table(report, "disagreements.parquet").to_pandas()
        dis.insert(0, "sample_id", dis["group_id"].astype(str) + ":" + dis["sample_index"].astype(str))
        return agreement, dis

    # ---------------------------------------------------------------------------------------- internals
    def _sets(self, run_id: str) -> list[SampleSet]:
        """The run's sample sets, found again only when its manifests were listed again."""
        manifests = self.manifests(run_id)
        cached = self._set_lists.get(run_id)
        if cached is None or cached[0] is not manifests:
            cached = (manifests, list_sets(self.store, run_id, manifests))
            self._set_lists[run_id] = cached
        return cached[1]

    def _find(self, run_id: str, kind: SampleKind, key: str) -> SampleSet:
        for s in self._sets(run_id):
            if s.kind == kind and s.key == key:
                return s
        raise ArtifactNotFoundError(f"run {run_id!r} has no committed {kind} sample set {key!r}")

    def _table(self, s: SampleSet) -> str:
        """The name of the set's table in the in-memory database (made on first use)."""
        with self._lock:
            name = self._tables.get(s.rollouts)
            if name is None:
                name = f"set_{len(self._tables)}"
                self._derived.create(name, s)
                self._tables[s.rollouts] = name
            return name

    def _has_trainer_logprobs(self, s: SampleSet) -> bool:
        if s.update is None:
            return False
        names = self._db.cursor().execute("SELECT name FROM parquet_schema(?)", [s.update]).fetchall()
        return ("old_log_probs",) in names

    def _tokenizer(self, s: SampleSet) -> Any:
        """The run's tokenizer: its template_pack stage's ``tokenizer.json`` read with ``tokenizers``
        (no torch import); None when the set names no template_pack stage."""
        uri = s.template_pack_uri
        if uri is None:
            return None
        with self._lock:
            if uri not in self._tokenizers:
                from tokenizers import Tokenizer

                tp = self.store.read_manifest(uri)
                text = self.store.read_bytes(tp, "tokenizer/tokenizer.json").decode()
                self._tokenizers[uri] = Tokenizer.from_str(text)
            return self._tokenizers[uri]


def _last(frame: pd.DataFrame, col: str) -> float | None:
    if col not in frame or frame[col].dropna().empty:
        return None
    return float(frame[col].dropna().iloc[-1])


def _with_garbled(page: pd.DataFrame) -> pd.DataFrame:
    """``page`` with the garbled columns of its rows that the background has not filled yet
    computed here (:func:`browse.garbled.garbled_reasons`)."""
    missing = page["garbled_reason"].isna().to_numpy() if len(page) else np.zeros(0, bool)
    if missing.any():
        reasons = page["garbled_reason"].tolist()
        found = garbled_reasons(page["response"][missing].tolist(), page["truncated"][missing].tolist())
        for i, reason in zip(np.flatnonzero(missing), found, strict=True):
            reasons[i] = reason
        page["garbled_reason"] = reasons
        page["garbled"] = [bool(r) for r in reasons]
    return page
