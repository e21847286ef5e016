"""Dated data snapshots: the newest dated directory wins, its files replace the names in the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.snapshot import DataSnapshot, newest_snapshot, resolve_snapshot
from verl_core.config import DataConfig, load_config, validate_config
from verl_core.errors import ConfigError, DataError


def test_newest_dated_snapshot_is_resolved_into_the_config(tmp_path: Path) -> None:
    for name in ("2026-11-20", "20261121", "2026-11-21T0300Z", "latest", "2027-notadate"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.jsonl").write_text('{"question": "1+1", "answer": "#### 2"}\n')
        (tmp_path / name / "test.jsonl").write_text('{"question": "2+2", "answer": "#### 4"}\n')
    assert newest_snapshot(str(tmp_path)).name == "2026-11-21T0300Z"  # same day, later time

    cfg = load_config(
        None, ["data.source=gsm8k", f"data.snapshot_prefix={tmp_path}", "data.train_files=[train.jsonl]"]
    )
    snapshot = resolve_snapshot.fn(cfg.data)
    assert snapshot.path == str(tmp_path / "2026-11-21T0300Z")
    resolved = cfg.model_copy(update={"data": snapshot.data})  # as the pipeline applies it
    assert resolved.data.train_files == [str(tmp_path / "2026-11-21T0300Z" / "train.jsonl")]
    assert resolved.data.val_files == []  # none named: the adapter's default split, as before
    assert resolved.data.snapshot_prefix is None  # run.json records the files, not the prefix
    # the copy is what validating the resolved config again gives (same run.json, same config hash)
    again = validate_config(resolved.model_dump(mode="json"))
    assert again == resolved and again.config_hash() == resolved.config_hash()
    with_val = cfg.data.model_copy(update={"val_files": ["test.jsonl"]})
    assert resolve_snapshot.fn(with_val).data.val_files == [str(tmp_path / "2026-11-21T0300Z" / "test.jsonl")]
    assert resolve_snapshot.fn(DataConfig()) == DataSnapshot(None, DataConfig())


def test_snapshot_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no dated snapshot directory"):
        newest_snapshot(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"^data.snapshot_prefix: 's3://b/p': snapshots are read from a local"
    ):
        newest_snapshot("s3://b/p")
    (tmp_path / "2026-01-01").mkdir()
    cfg = DataConfig(source="gsm8k", snapshot_prefix=str(tmp_path), train_files=["train.jsonl"])
    with pytest.raises(DataError, match=r"snapshot 2026-01-01: .*train.jsonl' does not exist"):
        resolve_snapshot.fn(cfg)
