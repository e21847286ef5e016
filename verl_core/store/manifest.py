"""The manifest: the one small object whose single PUT commits a stage's output."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from verl_core.errors import ArtifactCorruptError, ArtifactNotFoundError

MANIFEST_VERSION = 1


class FileEntry(BaseModel):
    """One file of a stage's output. ``path`` is relative to the stage directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    path: str
    kind: str | None
    rows: int | None
    size: int
    sha256: str
    arrow_schema: str | None


class Producer(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: str
    code_version: str
    host: str
    pid: int
    created_at: str


class Manifest(BaseModel):
    """A committed stage output: its files with sizes and hashes, the inputs it was made from, who
    made it, and a small JSON summary (row counts, report figures)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = MANIFEST_VERSION
    run_id: str
    stage: str
    attempt: str
    input_key: str
    inputs: dict[str, dict[str, str]]
    files: list[FileEntry]
    producer: Producer
    summary: dict[str, Any]

    def file(self, name: str) -> FileEntry:
        for entry in self.files:
            if entry.name == name:
                return entry
        names = ", ".join(f.name for f in self.files) or "none"
        raise ArtifactNotFoundError(
            f"stage {self.stage!r} of run {self.run_id!r} has no artifact {name!r} (it has: {names})"
        )

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        try:
            return cls.model_validate(json.loads(data))
        except (ValueError, ValidationError) as e:
            first = str(e).splitlines()[0]
            raise ArtifactCorruptError(f"{where}: not a valid manifest ({first})") from None


def stage_input_key(stage: str, params: Mapping[str, Any], input_hashes: Mapping[str, str]) -> str:
    """A manifest's ``input_key``, what a committed stage is recognised by (``ArtifactStore.open_stage``):
    sha256 of the canonical JSON of the stage name, its ``params`` and its inputs' manifest sha256s."""
    key_src = {"stage": stage, "params": dict(params), "inputs": dict(sorted(input_hashes.items()))}
    return hashlib.sha256(json.dumps(key_src, sort_keys=True, default=str).encode()).hexdigest()
