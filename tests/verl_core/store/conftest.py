"""Stores for the lease tests: memory://, a local directory and S3 (moto); and ``nocas://``, an fsspec
protocol (memory underneath) that offers no conditional write."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from verl_core.store import ArtifactStore


class NoCasFileSystem(MemoryFileSystem):
    protocol = "nocas"


fsspec.register_implementation("nocas", NoCasFileSystem, clobber=True)


@pytest.fixture(params=["memory", "local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "memory":
        return ArtifactStore(f"memory://lease-{uuid.uuid4().hex[:8]}")
    if request.param == "local":
        return ArtifactStore(str(tmp_path / "store"))
    return ArtifactStore(request.getfixturevalue("s3_bucket") + "/team")
