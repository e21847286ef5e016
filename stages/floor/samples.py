"""Per-sample tables: a few rollouts of each RL iteration (prompt, response, score, advantage) and of
each validation (prompt, response, score), logged to the run's tracker (MLflow ``samples/{kind}/
iter-XXXX.json``, readable with ``mlflow.load_table``; a ``wandb.Table``) and, inside a Prefect run,
as a table artifact. :func:`table_artifact` is the one way a verl-flow table artifact is made (the
pipeline's eval samples too).

Which rows: the first ``tracking.log_samples`` of the batch, in rollout order (whole prompt groups
first), so a rerun logs the same rows. Texts longer than :data:`MAX_TEXT_CHARS` are cut with a marker.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from verl_core.runtime.tracking import Tracker

MAX_TEXT_CHARS = 1000
_MARKDOWN_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")


def clip_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` cut to ``limit`` characters, ending in a marker that says how many were dropped."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [+{len(text) - limit} chars]"


def markdown_cell(text: str) -> str:
    """``text`` as a table cell that Prefect's markdown renders as written: punctuation escaped
    (``#`` headings, ``|``, ``*``, ``<think>`` tags stay text), each line break shown as `` ↵ `` (a
    row as tall as its wrapped text, not one line per line of a response)."""
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", text).replace("\r\n", "\n").replace("\n", " ↵ ")


def sample_columns(
    rollouts: pa.Table,
    scores: Sequence[float],
    limit: int,
    advantages: Sequence[float | None] | None = None,
) -> dict[str, list[Any]]:
    """The first ``limit`` samples of ``rollouts`` (kind "rollouts") with their ``scores`` (and
    ``advantages``) as table columns; ``scores`` and ``advantages`` are aligned with the rows that are
    samples, which ReMax's greedy baseline rows (``is_baseline``) are not."""
    if "is_baseline" in rollouts.column_names:
        rollouts = rollouts.filter(pc.invert(rollouts.column("is_baseline")))
    rows = rollouts.slice(0, limit)
    n = rows.num_rows
    columns: dict[str, list[Any]] = {
        "iteration": rows.column("iteration").to_pylist(),
        "group_id": rows.column("group_id").to_pylist(),
        "sample_index": rows.column("sample_index").to_pylist(),
        "prompt": [clip_text(t) for t in rows.column("prompt_text").to_pylist()],
        "response": [clip_text(t) for t in rows.column("response_text").to_pylist()],
        "response_length": rows.column("response_length").to_pylist(),
        "score": [float(s) for s in scores[:n]],
    }
    if advantages is not None:
        columns["advantage"] = list(advantages[:n])
    return columns


def samples_artifact_file(kind: str, iteration: int) -> str:
    """The tracker's name of a samples table: ``samples/train/iter-0003.json``."""
    return f"samples/{kind}/iter-{iteration:04d}.json"


def log_samples(tracker: Tracker, kind: str, iteration: int, columns: Mapping[str, Sequence[Any]]) -> None:
    """Log a samples table (``kind``: ``train`` or ``val``) to the tracker and as the Prefect table
    artifact ``{kind}-samples`` (one version per iteration)."""
    tracker.log_table(columns, samples_artifact_file(kind, iteration))
    rows = [
        {k: markdown_cell(v) if isinstance(v, str) else v for k, v in zip(columns, values, strict=True)}
        for values in zip(*columns.values(), strict=True)
    ]  # Prefect's UI renders cells as markdown: texts shown as written
    table_artifact(rows, key=f"{kind}-samples", description=f"{kind} samples of iteration {iteration}")


def table_artifact(rows: list[dict[str, Any]], key: str, description: str) -> None:
    """A Prefect table artifact of ``rows`` in the current flow or task run; nothing outside a run
    (a stage function called directly, as the benchmarks do)."""
    from prefect.artifacts import create_table_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if rows and (FlowRunContext.get() is not None or TaskRunContext.get() is not None):
        create_table_artifact(rows, key=key, description=description)
