"""Local-file primitives of the artifact store: an atomic, fsync'd write of bytes or of a local file's
content (hard-linked into place when it is on the same file system, so a multi-GB file is neither
copied nor read into memory), and the size and sha256 of either, read in pieces."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

Content = bytes | Path  # a file's bytes, or a local file holding them


def replace_atomic(path: str, data: Content) -> None:
    """Write ``data`` at ``path`` so readers see the old file or all of the new one: into
    ``{path}.tmp-*``, fsync, ``os.replace``. On a full disk the partial copy is removed (it would
    only hold space the rerun needs) and the ``OSError`` raised."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(data, Path):
            try:
                os.link(data, tmp)
            except OSError as e:  # another file system, or one without hard links
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
                shutil.copyfile(data, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        else:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and os.path.exists(tmp):
            os.remove(tmp)
        raise


def new_file(folder: str | None) -> Path:
    """A new empty file named ``.staging-*`` in ``folder`` (created if missing), with the mode any
    file the store writes has (it is linked into place), or a private one (mode 0600) in the
    system's temporary folder when None."""
    if folder is None:
        fd, tmp = tempfile.mkstemp(prefix=".staging-")
        os.close(fd)
        return Path(tmp)
    os.makedirs(folder, exist_ok=True)
    path = Path(folder) / f".staging-{uuid.uuid4().hex}"
    path.touch(exist_ok=False)  # 0o666 less the umask, as open(..., "wb") gives
    return path


def size_of(data: Content) -> int:
    return data.stat().st_size if isinstance(data, Path) else len(data)


def sha256_of(data: Content, chunk: int = 1 << 24) -> str:
    """sha256 of bytes, or of a file read in ``chunk``-byte pieces (never whole in memory)."""
    if not isinstance(data, Path):
        return hashlib.sha256(data).hexdigest()
    h = hashlib.sha256()
    with open(data, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
