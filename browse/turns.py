"""The turns of multi-turn responses (``rollout.multi_turn``): the rollouts table's ``turns`` column,
read for the few samples a page shows (the sample tables leave it out: a page of the grid needs
only the count of tool calls). A turn: role ("assistant": sampled by the model, "tool": the tool
output appended, masked out of the loss), text, and the calls a tool turn answers (name, arguments,
result, error). A single-turn response has no turns (an empty list)."""

from __future__ import annotations

from typing import Any

import pyarrow.parquet as pq
from pyarrow.fs import FSSpecHandler, PyFileSystem

from browse.queries import Catalog
from browse.sql import parse_sample_id


def sample_turns(catalog: Catalog, run_id: str, kind: str, key: str, sample_ids: list[str]) -> dict[str, Any]:
    """``{sample_id: [turn, ...]}`` for ``sample_ids`` of the set (kind, key); a turn is
    ``{"role", "text", "calls": [{"name", "arguments", "result", "error"}]}``."""
    sets = catalog.sample_sets(run_id)
    mine = sets[(sets["kind"] == kind) & (sets["key"] == key)] if not sets.empty else sets
    if mine.empty or not sample_ids:
        return {}
    uri = str(mine["uri"].iloc[0])
    fs = None
    if "://" in uri:  # an object store: read through the store's fsspec filesystem
        fs, uri = PyFileSystem(FSSpecHandler(catalog.store.fs)), uri.split("://", 1)[1]
    wanted = {parse_sample_id(s) for s in sample_ids}
    if "turns" not in pq.read_schema(uri, filesystem=fs).names:
        return {}
    table = pq.read_table(
        uri,
        columns=["group_id", "sample_index", "turns"],
        filters=[("group_id", "in", sorted({g for g, _ in wanted}))],
        filesystem=fs,
    )
    out: dict[str, Any] = {}
    for row in table.to_pylist():
        if (row["group_id"], row["sample_index"]) in wanted:
            turns = [
                {"role": t["role"], "text": t["text"], "calls": list(t.get("calls") or [])}
                for t in row["turns"] or []
            ]
            out[f"{row['group_id']}:{row['sample_index']}"] = turns
    return out
