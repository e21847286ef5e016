"""The artifact store: one URL per run root, any fsspec filesystem, a commit protocol that works on S3.

Layout under the root URL::

    runs/{run_id}/run.json                          resolved config, its hash, code version
    runs/{run_id}/{stage}/attempt-{ts}-{id}/...     data files of one attempt of a stage
    runs/{run_id}/{stage}/manifest.json             the commit: which attempt's files are the output

Commit protocol (S3 has no atomic rename): a stage writes every file under a fresh attempt prefix,
then publishes the manifest (paths, schema, rows, sha256, producer, input manifests' hashes) in a
single PUT. Readers only go through manifests, so a writer killed before its manifest leaves nothing
visible, and a rerun whose ``input_key`` (stage params + input manifest hashes) matches the
committed manifest is skipped. Stale attempts of a stage are deleted after the next commit.

Credentials and the S3 endpoint come from the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``), never from the config,
and are never logged.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import posixpath
import re
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from verl_core.errors import ArtifactCorruptError, ArtifactError, ArtifactNotFoundError, StoreFullError
from verl_core.store.local import Content, new_file, replace_atomic, sha256_of, size_of
from verl_core.store.manifest import FileEntry, Manifest, Producer, stage_input_key
from verl_core.store.schemas import check_schema, conform
from verl_core.version import code_version

_NAME_RE = re.compile(r"^[A-Za-z0-9_.=-]+(/[A-Za-z0-9_.=-]+)*$")
MANIFEST = "manifest.json"


def normalize_url(url: str) -> str:
    """``runs``, ``./runs``, ``file://runs`` → ``file:///abs/runs``; others unchanged, no trailing /."""
    url = url.rstrip("/") or url
    if "://" not in url:
        return Path(url).expanduser().resolve().as_uri()
    if url.startswith("file://"):
        rest = url[len("file://") :]
        return Path(rest).expanduser().resolve().as_uri()
    return url


def storage_options(url: str, max_attempts: int = 10) -> dict[str, Any]:
    """fsspec options for ``url``: for ``s3://``, the endpoint from the environment, botocore's
    standard retry mode, and no listing cache (other processes write to the same bucket)."""
    if not url.startswith(("s3://", "s3a://")):
        return {}
    opts: dict[str, Any] = {
        "use_listings_cache": False,
        "config_kwargs": {"retries": {"max_attempts": max_attempts, "mode": "standard"}},
    }
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["endpoint_url"] = endpoint
    return opts


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class RunRecord:
    """What ``run.json`` holds."""

    run_id: str
    config: dict[str, Any]
    config_hash: str
    code_version: str
    created_at: str
    updated_at: str
    origin: dict[str, Any] | None = None  # what the run started from (retrain.start_from), its data snapshot


class ArtifactStore:
    """Artifacts of every run under one root URL (``file://``, ``s3://``, ``memory://``)."""

    def __init__(self, url: str, *, max_attempts: int = 10, outage_budget_s: float = 300.0) -> None:
        """``max_attempts``: botocore attempts per S3 request; ``outage_budget_s``: how long an
        unreachable S3 endpoint is waited for (:mod:`verl_core.store.s3`). Both: ``store.*``."""
        self.url = normalize_url(url)
        options = storage_options(self.url, max_attempts)
        if self.url.startswith(("s3://", "s3a://")):
            from verl_core.store.s3 import s3_filesystem

            self.fs, self.root = s3_filesystem(self.url, options, outage_budget_s)
        else:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        self._local = "file" in _protocols(self.fs)

    def __repr__(self) -> str:
        return f"ArtifactStore({self.url!r})"

    # -------------------------------------------------------------------------------- paths and URIs
    def path(self, *parts: str) -> str:
        """Filesystem path (no protocol) under the root."""
        return posixpath.join(self.root, *parts)

    def uri(self, path: str) -> str:
        """Full URL of a filesystem path of this store."""
        return self.fs.unstrip_protocol(path)

    def run_dir(self, run_id: str) -> str:
        _check_name(run_id, "run_id")
        return self.path("runs", run_id)

    def manifest_uri(self, run_id: str, stage: str) -> str:
        _check_name(stage, "stage")
        return self.uri(posixpath.join(self.run_dir(run_id), stage, MANIFEST))

    # -------------------------------------------------------------------------------- raw I/O
    def put_atomic(self, path: str, data: Content) -> None:
        """Write ``data`` (bytes or a local file, never read whole) so that readers see nothing/the old
        bytes or all of the new ones: :func:`replace_atomic` locally, one PUT on object stores (a large
        file in a multipart upload, visible only once complete, each part retried like any request)."""
        if self._local:
            try:
                replace_atomic(path, data)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                where = posixpath.relpath(path, self.root)
                raise StoreFullError(
                    f"store {self.url}: no space left on the device writing {where} ({size_of(data)} bytes); "
                    "what was committed before is intact: free space and rerun to resume"
                ) from None
        elif isinstance(data, Path):
            self.fs.put_file(str(data), path)
        else:
            self.fs.pipe_file(path, data)

    def cat(self, path: str) -> bytes:
        try:
            data: bytes = self.fs.cat_file(path)
        except FileNotFoundError:
            raise ArtifactNotFoundError(f"{self.uri(path)} does not exist") from None
        return data

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    # -------------------------------------------------------------------------------- runs
    def write_run_record(
        self, run_id: str, config: dict[str, Any], config_hash: str, origin: dict[str, Any] | None = None
    ) -> RunRecord:
        """Create or update ``runs/{run_id}/run.json`` (created_at kept across reruns; origin if given)."""
        path = posixpath.join(self.run_dir(run_id), "run.json")
        now = _now()
        created = self.read_run_record(run_id).created_at if self.exists(path) else now
        record = RunRecord(run_id, config, config_hash, code_version(), created, now, origin)
        fields = {k: v for k, v in record.__dict__.items() if k != "origin" or v is not None}
        self.put_atomic(path, json.dumps(fields, indent=2, sort_keys=True).encode())
        return record

    def read_run_record(self, run_id: str) -> RunRecord:
        path = posixpath.join(self.run_dir(run_id), "run.json")
        try:
            return RunRecord(**json.loads(self.cat(path)))
        except (ValueError, TypeError) as e:
            raise ArtifactCorruptError(f"{self.uri(path)}: not a valid run record ({e})") from None

    def list_runs(self) -> list[str]:
        base = self.path("runs")
        if not self.exists(base):
            return []
        return sorted(
            posixpath.basename(p.rstrip("/"))
            for p in self.fs.ls(base, detail=False)
            if self.exists(posixpath.join(p, "run.json"))
        )

    def list_manifests(self, run_id: str) -> list[Manifest]:
        """Every committed stage of a run, in commit order."""
        found = self.fs.glob(posixpath.join(self.run_dir(run_id), "**", MANIFEST))
        manifests = [self.read_manifest(self.uri(p)) for p in found]
        return sorted(manifests, key=lambda m: (m.producer.created_at, m.stage))

    # -------------------------------------------------------------------------------- manifests
    def read_manifest(self, uri: str) -> Manifest:
        """Load and validate a manifest by URI (or store-relative path)."""
        path = self._to_path(uri)
        data = self.cat(path)
        return Manifest.from_bytes(data, where=self.uri(path))

    def manifest_sha256(self, uri: str) -> str:
        return sha256_bytes(self.cat(self._to_path(uri)))

    def committed(self, run_id: str, stage: str) -> Manifest | None:
        """The committed manifest of a stage, or None."""
        uri = self.manifest_uri(run_id, stage)
        if not self.exists(self._to_path(uri)):
            return None
        return self.read_manifest(uri)

    # -------------------------------------------------------------------------------- tables
    def read_table(self, manifest: Manifest, name: str, columns: list[str] | None = None) -> pa.Table:
        """Read the table ``name`` of a committed manifest, checking sha256, size and schema."""
        entry = manifest.file(name)
        data = self.read_bytes(manifest, name)
        where = self.uri(self._file_path(manifest, entry))
        try:
            table = pq.read_table(pa.BufferReader(data), columns=columns)
        except pa.ArrowException as e:
            raise ArtifactCorruptError(f"{where}: not a readable Parquet file ({e})") from None
        if entry.kind and columns is None:
            check_schema(table.schema, entry.kind, where)
        return table

    def read_bytes(self, manifest: Manifest, name: str) -> bytes:
        entry = manifest.file(name)
        path = self._file_path(manifest, entry)
        data = self.cat(path)
        self._check_content(path, entry, len(data), lambda: sha256_bytes(data))
        return data

    @contextmanager
    def local_file(self, manifest: Manifest, name: str) -> Iterator[Path]:
        """A local file holding ``name`` of a committed manifest, checked like :meth:`read_bytes`
        but never read whole into memory (multi-GB trainer state): the store's own file on a local
        store, a download to a temporary file (removed on exit) elsewhere."""
        entry = manifest.file(name)
        path = self._file_path(manifest, entry)
        tmp = None if self._local else new_file(None)
        try:
            try:
                if tmp is not None:
                    self.fs.get_file(path, str(tmp))
                local = tmp or Path(path)
                size = local.stat().st_size
            except FileNotFoundError:
                raise ArtifactNotFoundError(f"{self.uri(path)} does not exist") from None
            self._check_content(path, entry, size, lambda: sha256_of(local))
            yield local
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def _check_content(self, path: str, entry: FileEntry, size: int, sha256: Any) -> None:
        if size != entry.size or sha256() != entry.sha256:
            raise ArtifactCorruptError(
                f"{self.uri(path)}: content does not match its manifest "
                f"(size {size} vs {entry.size}, sha256 mismatch) — the artifact was changed after commit"
            )

    def file_uri(self, manifest: Manifest, name: str) -> str:
        return self.uri(self._file_path(manifest, manifest.file(name)))

    # -------------------------------------------------------------------------------- writing
    def open_stage(
        self,
        run_id: str,
        stage: str,
        *,
        params: Mapping[str, Any] | None = None,
        inputs: Mapping[str, str] | None = None,
        force: bool = False,
    ) -> StageWriter:
        """Start (or skip) a stage. ``params``: everything besides the inputs that determines the
        output (the stage's config section); ``inputs``: name → manifest URI of upstream stages.
        ``force``: write a new attempt even when committed with the same inputs (for stages whose
        side effects, e.g. weights kept in memory, must be recomputed)."""
        input_hashes = {k: self.manifest_sha256(v) for k, v in sorted((inputs or {}).items())}
        input_key = stage_input_key(stage, params or {}, input_hashes)
        existing = self.committed(run_id, stage)
        if (
            not force
            and existing is not None
            and existing.input_key == input_key
            and self.files_present(existing)
        ):
            return StageWriter(self, run_id, stage, input_key, dict(inputs or {}), input_hashes, existing)
        return StageWriter(self, run_id, stage, input_key, dict(inputs or {}), input_hashes, None)

    def publish(self, manifest: Manifest) -> str:
        """Commit a sealed manifest (see :meth:`StageWriter.seal`): one PUT, then delete the stage's
        other attempts. Returns the manifest URI."""
        stage_dir = posixpath.join(self.run_dir(manifest.run_id), manifest.stage)
        self.put_atomic(posixpath.join(stage_dir, MANIFEST), manifest.to_bytes())
        for p in self.fs.ls(stage_dir, detail=False):
            base = posixpath.basename(p.rstrip("/"))
            if base.startswith("attempt-") and base != manifest.attempt:
                self.fs.rm(p, recursive=True)
        return self.manifest_uri(manifest.run_id, manifest.stage)

    def delete_stage(self, run_id: str, stage: str) -> None:
        """Remove a committed stage: the manifest first (so it is never visible half-deleted), then
        its files. For pruning old checkpoints."""
        stage_dir = posixpath.join(self.run_dir(run_id), stage)
        manifest = posixpath.join(stage_dir, MANIFEST)
        if self.exists(manifest):
            self.fs.rm(manifest)
        if self.exists(stage_dir):
            self.fs.rm(stage_dir, recursive=True)

    def files_present(self, manifest: Manifest) -> bool:
        """Whether every file of ``manifest`` exists with its recorded size."""
        for entry in manifest.files:
            path = self._file_path(manifest, entry)
            try:
                info = self.fs.info(path)
            except FileNotFoundError:
                return False
            if int(info.get("size", -1)) != entry.size:
                return False
        return True

    def _file_path(self, manifest: Manifest, entry: FileEntry) -> str:
        return posixpath.join(self.run_dir(manifest.run_id), manifest.stage, entry.path)

    def _to_path(self, uri: str) -> str:
        if "://" in uri:
            if not uri.startswith(self.url.split("://")[0] + "://"):
                raise ArtifactError(f"{uri} is not in the store {self.url}")
            return str(self.fs._strip_protocol(uri))
        return self.path(uri)


class StageWriter:
    """Writes one attempt of a stage and commits it. ``done`` is True when the stage was already
    committed with the same inputs: then ``manifest`` / ``manifest_uri`` are the committed ones."""

    def __init__(
        self,
        store: ArtifactStore,
        run_id: str,
        stage: str,
        input_key: str,
        inputs: dict[str, str],
        input_hashes: dict[str, str],
        existing: Manifest | None,
    ) -> None:
        self.store, self.run_id, self.stage = store, run_id, stage
        self.input_key, self.inputs, self.input_hashes = input_key, inputs, input_hashes
        self.manifest = existing
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        self.attempt = f"attempt-{stamp}-{uuid.uuid4().hex[:8]}"
        self._files: list[FileEntry] = []

    @property
    def done(self) -> bool:
        return self.manifest is not None

    @property
    def manifest_uri(self) -> str:
        return self.store.manifest_uri(self.run_id, self.stage)

    def _stage_dir(self) -> str:
        return posixpath.join(self.store.run_dir(self.run_id), self.stage)

    def write_table(self, name: str, table: pa.Table, kind: str) -> FileEntry:
        """Write ``table`` as zstd Parquet under the attempt prefix, conformed to ``kind``'s schema."""
        self._check_open(name)
        where = f"{self.stage}/{name}"
        table = conform(table, kind, where)
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        return self._put(name, buf.getvalue(), kind=kind, rows=table.num_rows, schema=str(table.schema))

    def write_bytes(self, name: str, data: Content) -> FileEntry:
        """Write an opaque file (JSON report, weights, tokenizer file) under the attempt prefix: bytes,
        or a local file's content, streamed (never read whole: GBs of weights)."""
        self._check_open(name)
        return self._put(name, data, kind=None, rows=None, schema=None)

    def write_json(self, name: str, obj: Any) -> FileEntry:
        return self.write_bytes(name, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    @contextmanager
    def staged_file(self, name: str) -> Iterator[Path]:
        """A local path to write the opaque file ``name`` to; on exit it is put under the attempt
        prefix like :meth:`write_bytes`, its content never one bytes object (multi-GB trainer state).
        On a local store the path is in the attempt's folder, so the file is linked into place."""
        self._check_open(name)
        tmp = new_file(posixpath.join(self._stage_dir(), self.attempt) if self.store._local else None)
        try:
            yield tmp
            self._put(name, tmp, kind=None, rows=None, schema=None)
        finally:
            tmp.unlink(missing_ok=True)

    def _check_open(self, name: str) -> None:
        if self.done:
            raise ArtifactError(f"stage {self.stage!r} of run {self.run_id!r} is already committed")
        _check_name(name, "artifact name")
        if any(f.name == name for f in self._files):
            raise ArtifactError(f"{self.stage}: artifact {name!r} written twice in one attempt")

    def _put(
        self, name: str, data: Content, kind: str | None, rows: int | None, schema: str | None
    ) -> FileEntry:
        rel = posixpath.join(self.attempt, name)
        self.store.put_atomic(posixpath.join(self._stage_dir(), rel), data)
        size, sha256 = size_of(data), sha256_of(data)
        entry = FileEntry(
            name=name, path=rel, kind=kind, rows=rows, size=size, sha256=sha256, arrow_schema=schema
        )
        self._files.append(entry)
        return entry

    def commit(self, summary: Mapping[str, Any] | None = None) -> str:
        """Publish the manifest in one PUT, delete stale attempts, return the manifest URI."""
        manifest = self.seal(summary)
        uri = self.store.publish(manifest)
        self.manifest = manifest
        return uri

    def seal(self, summary: Mapping[str, Any] | None = None) -> Manifest:
        """The manifest of the files written so far, *not* published: for a commit that must wait
        until something else is durable (:meth:`ArtifactStore.publish` it then)."""
        if self.done:
            raise ArtifactError(f"stage {self.stage!r} of run {self.run_id!r} is already committed")
        return Manifest(
            run_id=self.run_id,
            stage=self.stage,
            attempt=self.attempt,
            input_key=self.input_key,
            inputs={k: {"uri": v, "sha256": self.input_hashes[k]} for k, v in self.inputs.items()},
            files=list(self._files),
            producer=Producer(
                stage=self.stage,
                code_version=code_version(),
                host=os.uname().nodename,
                pid=os.getpid(),
                created_at=_now(),
            ),
            summary=dict(summary or {}),
        )


def _check_name(name: str, what: str) -> None:
    if not _NAME_RE.match(name) or ".." in name.split("/"):
        raise ArtifactError(f"invalid {what} {name!r}: use letters, digits, '_', '-', '.', '=' and '/'")


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")
