"""Per-sample tables (stages/floor/samples.py): which rows, which columns, long texts cut."""

from __future__ import annotations

import pyarrow as pa

from stages.floor.samples import clip_text, sample_columns, samples_artifact_file


def _rollouts(texts: list[str], baseline: list[bool]) -> pa.Table:
    n = len(texts)
    return pa.table(
        {
            "iteration": [5] * n,
            "group_id": [i // 2 for i in range(n)],
            "sample_index": [i % 2 for i in range(n)],
            "prompt_text": [f"p{i // 2}" for i in range(n)],
            "response_text": texts,
            "response_length": [len(t) for t in texts],
            "is_baseline": baseline,
        }
    )


def test_sample_columns_take_the_first_samples_and_skip_baseline_rows() -> None:
    # rows 0-3: group 0 (sample 0, baseline), group 1 (sample 0, baseline); scores/advantages are
    # aligned with the two samples only (rows 0 and 2), as RolloutBatch.from_tables aligns them
    rollouts = _rollouts(["a", "greedy-0", "b", "greedy-1"], [False, True, False, True])
    cols = sample_columns(rollouts, [1.0, 0.0], limit=8, advantages=[0.5, -0.5])
    assert cols == {
        "iteration": [5, 5],
        "group_id": [0, 1],
        "sample_index": [0, 0],
        "prompt": ["p0", "p1"],
        "response": ["a", "b"],
        "response_length": [1, 1],
        "score": [1.0, 0.0],
        "advantage": [0.5, -0.5],
    }
    first = sample_columns(rollouts, [1.0, 0.0], limit=1)
    assert first["response"] == ["a"] and "advantage" not in first  # validation: no advantage


def test_long_texts_are_cut_with_a_marker() -> None:
    assert clip_text("abc", limit=3) == "abc"
    assert clip_text("abcdef", limit=2) == "ab… [+4 chars]"
    assert samples_artifact_file("val", 3) == "samples/val/iter-0003.json"


def test_the_prefect_table_shows_texts_as_written_and_the_tracker_gets_them_raw(monkeypatch) -> None:
    # Prefect's UI renders table cells as markdown: "#### 4" would become a heading, a line break a new
    # row height. The artifact's cells are escaped (each punctuation mark behind a backslash, line
    # breaks as " ↵ "); the tracker's table (MLflow, W&B) keeps the texts unchanged.
    import stages.floor.samples as samples

    logged: dict[str, object] = {}
    shown: list[list[dict[str, object]]] = []

    class Tracker:
        def log_table(self, columns: object, name: str) -> None:
            logged[name] = columns

    monkeypatch.setattr(samples, "table_artifact", lambda rows, key, description: shown.append(rows))
    columns = {"response": ["2 + 2 = 4\n#### 4"], "score": [1.0]}
    samples.log_samples(Tracker(), "train", 3, columns)  # type: ignore[arg-type]
    assert logged["samples/train/iter-0003.json"] == columns
    assert shown == [[{"response": "2 \\+ 2 \\= 4 ↵ \\#\\#\\#\\# 4", "score": 1.0}]]
