"""The run's initial model on this machine's disk, when ``model.path`` names an export by its store URI.

``retrain.start_from=champion`` with a store that is not a shared directory (S3) in
``execution.mode=deployments`` sets ``model.path`` to the champion's export manifest URI
(``s3://.../runs/RUN/export/iter-XXXX/manifest.json``): the pipeline on the cpu pool and the stage
flows on the gpu pool run on different machines, and a local path of one is nothing on the other.
The config keeps the URI everywhere (run.json, the config hash, the stage keys, the policy lineage),
so every process names the initial model alike and a stage resumed on another worker matches its
keys. Each process that loads the initial model calls :func:`fetch_initial_model` once at its entry
(the pipeline flow, the sft / rl-loop / export flows, every rank of an SPMD job); the loaders pass
:func:`model_dir` of ``model.path`` to transformers: the path itself (a hub id, a directory), or this
process's copy of the URI.

The copy is :data:`CHAMPION_CACHE` ``/<sha256 of the export's manifest>``: written beside
(``.<sha>.partial-XXXXXXXX``) then renamed, under an exclusive lock file per export
(``.locks/<sha>``), so two flows on one worker fetch it once and the other reuses it; a copy present
is reused without reading the store but its manifest. Every file is checked against the size and
sha256 its manifest recorded as it is read: an export that is missing or damaged fails naming the URI,
and nothing half-written is left under the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from stages.floor.logging import stage_logger
from verl_core.errors import ArtifactCorruptError, ArtifactError, ArtifactNotFoundError, ConfigError
from verl_core.files import write_files

if TYPE_CHECKING:
    from verl_core.config import StoreConfig, VerlFlowConfig
    from verl_core.store import ArtifactStore, Manifest

CHAMPION_CACHE = Path.home() / ".verl-flow" / "champions"  # local copies of exports from remote stores
MODEL_DIR = "model/"  # an export's HF model dir (stages.floor.artifacts.MODEL_PREFIX)
_FETCHED: dict[str, str] = {}  # store URI → this process's copy (fetch_initial_model)
_ENTRY_STORE: list[StoreConfig] = []  # the run's store, set by fetch_initial_model at the entry


def is_store_uri(path: str | None) -> bool:
    """Whether ``model.path`` names an artifact in a store (``s3://``, ``memory://``, ...), not a hub
    id or a directory (a ``file://`` store's exports are directories: named by their path)."""
    return path is not None and "://" in path and not path.startswith("file://")


def cached_export(store: ArtifactStore, uri: str) -> Path:
    """This machine's copy of the export ``uri`` (its ``model/`` files) under :data:`CHAMPION_CACHE`,
    fetched when absent (module docstring); an :class:`~verl_core.errors.ArtifactError` naming
    ``uri`` when the export cannot be read or its files do not match its manifest."""
    try:
        manifest = store.read_manifest(uri)
        sha = store.manifest_sha256(uri)
    except (ArtifactError, OSError) as e:
        raise ArtifactNotFoundError(f"model.path {uri}: the export cannot be read ({e})") from None
    cached = CHAMPION_CACHE / sha
    if (cached / "config.json").is_file():
        return cached
    with _exclusive(CHAMPION_CACHE / ".locks" / sha):
        if (cached / "config.json").is_file():  # another process fetched it while this one waited
            return cached
        _fetch(store, manifest, uri, cached)
    return cached


def _fetch(store: ArtifactStore, manifest: Manifest, uri: str, cached: Path) -> None:
    partial = cached.with_name(f".{cached.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        partial.mkdir(parents=True)
        for f in manifest.files:  # one file in memory at a time, checked against the manifest
            if f.name.startswith(MODEL_DIR):
                write_files({f.name[len(MODEL_DIR) :]: store.read_bytes(manifest, f.name)}, partial)
        complete = (partial / "config.json").is_file()
        if complete:
            if cached.exists():  # a copy without config.json: not one this module finished
                shutil.rmtree(cached)
            os.replace(partial, cached)
    except (ArtifactError, OSError, ValueError) as e:  # a file missing, changed after commit, ...
        raise ArtifactCorruptError(f"model.path {uri}: the export cannot be copied here ({e})") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    if not complete:
        raise ArtifactNotFoundError(f"model.path {uri}: the export holds no model/config.json")


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock`` (created) for the block: one process or thread at a time."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_initial_model(cfg: VerlFlowConfig) -> str | None:
    """At a process's entry: when ``model.path`` is a store URI (and the model pretrained), fetch the
    export into this machine's cache (once; reused after) for :func:`model_dir`; returns the local
    directory, None when ``model.path`` needs nothing (a hub id, a directory, a scratch model)."""
    _ENTRY_STORE[:] = [cfg.store]
    path = cfg.model.path
    if cfg.model.init != "pretrained" or path is None or not is_store_uri(path):
        return None
    return _fetch_uri(cfg.store, path)


def _fetch_uri(s: StoreConfig, uri: str) -> str:
    from verl_core.store import ArtifactStore

    store = ArtifactStore(s.url, max_attempts=s.max_attempts, outage_budget_s=s.outage_budget_s)
    local = str(cached_export(store, uri))
    _FETCHED[uri] = local
    stage_logger(__name__).info("initial model %s: this machine's copy %s", uri, local)
    return local


def model_dir(path: str) -> str:
    """What a loader passes to transformers for ``model.path``: ``path`` itself, or this process's copy
    of a store URI (:func:`fetch_initial_model`, called at the process's entry). Another URI than the
    run's initial model (a fork's reference: its root run's initial model) is fetched here, from the
    store the entry named."""
    if not is_store_uri(path):
        return path
    local = _FETCHED.get(path)
    if local is None and _ENTRY_STORE:
        local = _fetch_uri(_ENTRY_STORE[0], path)
    if local is None:
        raise ConfigError(
            f"model.path {path}: an export in the store that this process has not fetched "
            "(stages.floor.initial_model.fetch_initial_model belongs at its flow's entry)"
        )
    return local
