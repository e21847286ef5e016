"""verl_core.files: a flat directory as {name: bytes} and back (models and tokenizers in the store)."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_core.files import read_files, write_files


def test_roundtrip_reads_plain_files_sorted(tmp_path: Path) -> None:
    files = {"b.json": b"{}", "a.safetensors": b"\x00\x01"}
    out = write_files(files, tmp_path / "new" / "dir")  # parents created
    (out / "sub").mkdir()  # folders are not files: left out
    assert read_files(out) == files
    assert list(read_files(out)) == ["a.safetensors", "b.json"]


@pytest.mark.parametrize("name", ["../escape", "sub/x", ".hidden"])
def test_names_cannot_leave_or_hide_in_the_directory(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=f"unexpected file name {name!r}"):
        write_files({name: b""}, tmp_path)
    assert list(tmp_path.iterdir()) == []
