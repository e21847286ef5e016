"""The store's local-file primitives: a local file is linked into place (same inode: no copy), copied
across file systems, and hashed in pieces to the same sha256 as its bytes."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from verl_core.store.local import new_file, replace_atomic, sha256_of, size_of


def test_a_file_on_the_same_file_system_is_linked_not_copied(tmp_path: Path) -> None:
    src = tmp_path / "staged"
    src.write_bytes(b"moments" * 100)
    dest = tmp_path / "attempt" / "trainer_state.pt"
    replace_atomic(str(dest), src)
    assert dest.read_bytes() == b"moments" * 100
    assert dest.stat().st_ino == src.stat().st_ino  # one inode, two names: nothing was copied
    assert sorted(p.name for p in dest.parent.iterdir()) == ["trainer_state.pt"]  # no .tmp- left


def test_a_file_on_another_file_system_is_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def cross_device(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "link", cross_device)
    src = tmp_path / "staged"
    src.write_bytes(b"abc")
    dest = tmp_path / "d" / "f"
    replace_atomic(str(dest), src)
    assert dest.read_bytes() == b"abc" and dest.stat().st_ino != src.stat().st_ino


def test_other_link_errors_are_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(src: object, dst: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "link", denied)
    src = tmp_path / "staged"
    src.write_bytes(b"abc")
    with pytest.raises(OSError) as e:
        replace_atomic(str(tmp_path / "f"), src)
    assert e.value.errno == errno.EIO and not (tmp_path / "f").exists()


def test_a_file_hashes_in_pieces_like_its_bytes(tmp_path: Path) -> None:
    data = os.urandom(1000)
    (tmp_path / "f").write_bytes(data)
    # 1000 bytes in pieces of 7: 142 full pieces and one of 6, the digest of the whole
    assert sha256_of(tmp_path / "f", chunk=7) == sha256_of(data) == hashlib.sha256(data).hexdigest()
    assert size_of(tmp_path / "f") == size_of(data) == 1000


def test_a_staged_file_in_the_store_gets_the_mode_of_the_stores_files(tmp_path: Path) -> None:
    # it becomes the store's file by a link: the mode of any file open(..., "wb") makes, not
    # mkstemp's 0600; outside the store (an upload's staging copy) it stays private
    (tmp_path / "plain").write_bytes(b"")
    staged = new_file(str(tmp_path / "attempt"))
    assert staged.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777
    private = new_file(None)
    try:
        assert private.stat().st_mode & 0o777 == 0o600
    finally:
        private.unlink()
