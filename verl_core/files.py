"""A directory of files as ``{file name: bytes}`` and back: how models and tokenizers travel through
the artifact store (``save_pretrained`` writes a flat directory; stages store its files)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def read_files(directory: str | os.PathLike[str]) -> dict[str, bytes]:
    """The plain files directly in ``directory`` as ``{name: bytes}``, sorted by name."""
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}


def write_files(files: Mapping[str, bytes], directory: str | os.PathLike[str]) -> Path:
    """Write ``{name: bytes}`` into ``directory`` (created) and return it.

    Names must be plain file names (no ``/``, no leading dot): the bytes come from the store and are
    never allowed to write outside ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"unexpected file name {name!r}: expected a plain name, no '/' or leading '.'")
        (out / name).write_bytes(data)
    return out
