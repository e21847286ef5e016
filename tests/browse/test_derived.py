"""browse.derived: the vectorised mismatch statistics against the readable reference
(browse.sql.mismatch_stats) on hand-made log-probs, across chunks, with rows matched by key."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from browse import derived
from browse.derived import mismatch_arrays, mismatch_table
from browse.sql import mismatch_stats

F = pa.list_(pa.float32())
BEHAVIOUR = [
    [-1.0, -2.0, -3.0],  # |d| = 0, 0.5, 0.5: max 0.5 first at 1, mean 1/3
    [-0.5],
    [-1.0, -2.0],  # trainer shorter: the common prefix only
    [-1.0],  # behaviour shorter
    None,  # no behaviour values: no statistics
    [],
    [-1.0, -math.inf, -2.0],  # -inf - -inf = NaN: the max, at 1
    [-0.25, -4.0],
    [-3.0, -1.0, -3.0, -1.0],  # a tie: the first position of the max
]
TRAINER = [
    [-1.0, -2.5, -2.5],
    [-0.25],
    [-1.5],
    [-1.0, -9.0],
    [-1.0],
    [-1.0],
    [-1.5, -math.inf, -9.0],
    [-0.5, -4.25],
    [-2.0, -1.0, -2.0, -1.0],
]


def _check(got: tuple, want: list[tuple[float, float, int]]) -> None:
    for gm, gmean, garg, (wm, wmean, warg) in zip(*got, want, strict=True):
        assert garg == warg
        assert (math.isnan(gm) and math.isnan(wm)) or gm == pytest.approx(wm, abs=0)
        assert (math.isnan(gmean) and math.isnan(wmean)) or gmean == pytest.approx(wmean)


@pytest.mark.parametrize("chunk", [3, 8192])
def test_mismatch_arrays_equal_the_reference(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # CHUNK_ROWS=3: rows with no common position at a chunk's start, middle and end
    monkeypatch.setattr(derived, "CHUNK_ROWS", chunk)
    want = [mismatch_stats(b, t) for b, t in zip(BEHAVIOUR, TRAINER, strict=True)]
    assert want[0] == (0.5, 1 / 3, 1) and want[4][2] == -1 and want[8][2] == 0  # hand-checked rows
    _check(mismatch_arrays(pa.array(BEHAVIOUR, F), pa.array(TRAINER, F)), want)
    # a sliced array (offsets not from 0) and a chunked one answer the same
    sliced = mismatch_arrays(
        pa.array([[9.0], *BEHAVIOUR], F)[1:], pa.chunked_array([TRAINER[:4], TRAINER[4:]], F)
    )
    _check(sliced, want)


def test_mismatch_table_matches_rows_by_key(tmp_path: Path) -> None:
    # the update written in reverse order and without sample 0:1: rows matched by (group, index)
    n = len(BEHAVIOUR)
    keys = {"group_id": [i // 2 for i in range(n)], "sample_index": [i % 2 for i in range(n)]}
    pq.write_table(pa.table({**keys, "logprobs": pa.array(BEHAVIOUR, F)}), tmp_path / "r.parquet")
    rev = [i for i in reversed(range(n)) if i != 1]
    update = {k: [v[i] for i in rev] for k, v in keys.items()}
    update["old_log_probs"] = pa.array([TRAINER[i] for i in rev], F)
    pq.write_table(pa.table(update), tmp_path / "u.parquet")
    got = mismatch_table(str(tmp_path / "r.parquet"), str(tmp_path / "u.parquet"))
    assert got["group_id"].to_pylist() == keys["group_id"]  # the rollouts' rows, in their order
    trainer = [None if i == 1 else t for i, t in enumerate(TRAINER)]
    want = [mismatch_stats(b, t) for b, t in zip(BEHAVIOUR, trainer, strict=True)]
    assert want[1][2] == -1  # no trainer values for 0:1
    columns = ("max_abs_mismatch", "mean_abs_mismatch", "argmax_position")
    _check(tuple(got[c].to_numpy() for c in columns), want)


def test_mismatch_table_streams_files_in_the_same_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # both files hold the samples in one order: read in lockstep batches of CHUNK_ROWS=4 (3 batches)
    monkeypatch.setattr(derived, "CHUNK_ROWS", 4)
    keys = {"group_id": list(range(len(BEHAVIOUR))), "sample_index": [0] * len(BEHAVIOUR)}
    pq.write_table(pa.table({**keys, "logprobs": pa.array(BEHAVIOUR, F)}), tmp_path / "r.parquet")
    pq.write_table(pa.table({**keys, "old_log_probs": pa.array(TRAINER, F)}), tmp_path / "u.parquet")
    got = derived._streamed_stats(str(tmp_path / "r.parquet"), str(tmp_path / "u.parquet"), None)
    assert got is not None and got["group_id"].to_pylist() == keys["group_id"]
    columns = ("max_abs_mismatch", "mean_abs_mismatch", "argmax_position")
    want = [mismatch_stats(b, t) for b, t in zip(BEHAVIOUR, TRAINER, strict=True)]
    _check(tuple(got[c].to_numpy() for c in columns), want)
