"""Artifact store: fsspec URLs, Parquet with explicit schemas, manifest-based commits."""

from verl_core.store.manifest import FileEntry, Manifest
from verl_core.store.schemas import artifact_kinds, get_schema, register_schema
from verl_core.store.store import ArtifactStore, RunRecord, StageWriter, normalize_url, storage_options

__all__ = [
    "ArtifactStore",
    "FileEntry",
    "Manifest",
    "RunRecord",
    "StageWriter",
    "artifact_kinds",
    "get_schema",
    "normalize_url",
    "register_schema",
    "storage_options",
]
