"""Dated data snapshots: ``data.snapshot_prefix`` holds one directory per snapshot, named by its date
(``2026-11-21``, ``20261121`` or ``2026-11-21T0300Z``); the newest one is used and recorded.

The config's ``data.train_files`` / ``data.val_files`` are then file names inside the snapshot; the
resolved ``data`` section (which the pipeline puts into the config it writes to ``run.json``) holds
the full paths and no prefix, so the run records exactly which snapshot it read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from prefect import task

from verl_core.config import DataConfig
from verl_core.errors import ConfigError, DataError

_DATED = re.compile(r"^(\d{4})-?(\d{2})-?(\d{2})(?:T(\d{4,6})Z?)?$")


def newest_snapshot(prefix: str) -> Path:
    """The newest dated directory under ``prefix`` (a local or shared-filesystem directory)."""
    if "://" in prefix and not prefix.startswith("file://"):
        raise ConfigError(
            f"data.snapshot_prefix: {prefix!r}: snapshots are read from a local or shared-filesystem "
            "directory (the data readers open local files)"
        )
    root = Path(prefix.removeprefix("file://")).expanduser()
    if not root.is_dir():
        raise DataError(f"data.snapshot_prefix: {str(root)!r} is not a directory")
    dated = []
    for entry in root.iterdir():
        m = _DATED.match(entry.name)
        if entry.is_dir() and m:
            dated.append(("".join(m.group(1, 2, 3)) + (m.group(4) or "").ljust(6, "0"), entry))
    if not dated:
        raise DataError(
            f"data.snapshot_prefix: no dated snapshot directory (YYYY-MM-DD, YYYYMMDD) under {str(root)!r}"
        )
    return max(dated)[1]


@dataclass(frozen=True)
class DataSnapshot:
    """The data snapshot a run reads: its directory (None without ``data.snapshot_prefix``) and the
    ``data`` section pointing at its files (the given section, unchanged, without a prefix)."""

    path: str | None
    data: DataConfig


@task(name="resolve-snapshot")
def resolve_snapshot(data: DataConfig) -> DataSnapshot:
    """The newest snapshot under ``data.snapshot_prefix`` and ``data`` with its files' full paths and
    no prefix."""
    if data.snapshot_prefix is None:
        return DataSnapshot(None, data)
    snapshot = newest_snapshot(data.snapshot_prefix)
    if not data.train_files:
        raise ConfigError("data.train_files: name the training file(s) inside each snapshot directory")

    def inside(names: list[str]) -> list[str]:
        paths = [os.path.join(snapshot, n) for n in names]
        for p in paths:
            if not os.path.isfile(p):
                raise DataError(f"snapshot {snapshot.name}: {p!r} does not exist")
        return paths

    # no field these touch has a validator (plain lists of strings, an optional string), so a copy
    # with the update is as valid as the section it came from
    update = {"train_files": inside(data.train_files), "snapshot_prefix": None}
    if data.val_files:
        update["val_files"] = inside(data.val_files)
    return DataSnapshot(str(snapshot), data.model_copy(update=update))
