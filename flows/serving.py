"""Serving an export: ``verl-flow serve TARGET`` and the ``serve-model`` deployment (gpu pool).

:func:`resolve_model` finds what TARGET names, without copying it when it can be read in place:

- ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``: the registered model version (MLflow's registry,
  ``stages.floor.registry.resolve``), whose tag ``verl_flow.export_uri`` is the export's manifest in
  the store;
- a run id: its latest export in the store (``--store``);
- a directory holding ``config.json``: served as it is.

An export of a local store is served from the store's own files (no copy). An export of a remote store
(S3, ...) is written out once into the state directory's cache (``cache/<manifest sha256>``) and reused
by every later serve of the same export; a half-written copy is removed (see
:mod:`verl_core.runtime.serve_records` for the layout).

What the server reports: ``/v1/models`` lists ``NAME/VERSION`` (the name every response carries) and
``NAME@ALIAS`` when served by alias (a run id or a directory: its name), each with ``root`` =
``<state dir>/<NAME>/sha256-<digest>``, the digest of the weights (:func:`~verl_core.runtime.serving.
weights_digest`: the sha256 of ``model.safetensors``, read from the export manifest's file digests).
The record (``verl-flow serve status``) holds the same.

:func:`start` starts the server for a :class:`ServedModel` and writes its record; :func:`serving`
does the same for the duration of a ``with`` block (stops it and removes the record at the end).
A name is served once: a second start of a served name is refused unless ``replace`` (then the
running one is stopped first, whoever started it).

:func:`serve_model` is the deployment's flow: serve TARGET until the flow run is cancelled. Its
automation (prefect.yaml) runs it on every ``verl-flow.model.promoted`` event with
``models:/NAME@champion``: the new run replaces the server the previous run of that name holds
(stops it through its record, then starts the new champion); the previous flow run then ends
Completed ("replaced"). Records are per machine: the replacement works when both flow runs run on
the same worker host (one serving machine per model name).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow

from stages.floor.artifacts import MODEL_PREFIX, materialise_export
from stages.floor.locations import list_exports
from verl_core.config import StoreConfig
from verl_core.errors import ArtifactNotFoundError
from verl_core.runtime import serve_records as records
from verl_core.runtime.serving import (
    ServeConfig,
    ServeError,
    ServerHandle,
    directory_digest,
    start_server,
    weights_digest,
)
from verl_core.store import ArtifactStore, Manifest

SOURCE_TAG = "verl_flow.source_stage"  # export lineage: the policy stage an export was made from
TOOL_FORMAT_PARSERS = {"hermes": "hermes"}  # rollout.multi_turn.format -> vLLM's --tool-call-parser


@dataclass(frozen=True)
class ServedModel:
    """What is served: an HF model directory, the name its record goes by, the names it is served
    under (responses carry the first), the registered version and the weights' digest."""

    model_dir: Path
    name: str  # the registered model name, the run id, or the directory's name
    names: list[str] = field(default_factory=list)
    version: str | None = None
    digest: str = ""
    tool_format: str | None = None  # rollout.multi_turn.format when the run trained with tools
    target: str = ""

    def served_names(self, override: str | None = None) -> list[str]:
        names = [override] if override else []
        return names + [n for n in (self.names or [self.name]) if n not in names]

    def tool_call_parser(self, setting: str | None) -> str | None:
        """``setting`` (``serve.tool_call_parser``), else the parser of the run's tool format."""
        if setting is not None:
            return None if setting == "none" else setting
        return TOOL_FORMAT_PARSERS.get(self.tool_format or "")


def resolve_model(target: str, store_url: str, tracking_uri: str | None = None) -> ServedModel:
    """``target``: ``models:/NAME@ALIAS``, ``models:/NAME/VERSION`` (the registry at
    ``tracking_uri``; None: the default for ``store_url``), an HF model directory (has config.json),
    else a run id of the store at ``store_url`` (its latest export, the last committed)."""
    if target.startswith("models:/"):
        return _registered(target, store_url, tracking_uri)
    path = Path(target).expanduser()
    if (path / "config.json").is_file():
        model_dir = path.resolve()
        return ServedModel(model_dir, model_dir.name, [], None, directory_digest(model_dir), None, target)
    store = ArtifactStore(store_url)
    if not store.list_manifests(target):
        raise ArtifactNotFoundError(
            f"{target!r} is neither models:/NAME@ALIAS, a model directory (config.json) nor a run in "
            f"{store_url}"
        )
    exports = list_exports(store, target)  # in commit order, as `verl-flow eval` picks
    if not exports:
        raise ArtifactNotFoundError(f"run {target!r} has no export; run `verl-flow export {target}` first")
    manifest = store.read_manifest(store.manifest_uri(target, exports[-1]))
    return _export(store, manifest, target, [target], None, target)


def _registered(target: str, store_url: str, tracking_uri: str | None) -> ServedModel:
    """The export a registered version was made from: its tag ``verl_flow.export_uri`` (the export's
    manifest, in whichever store holds it), else its run id and source stage in ``store_url``."""
    from stages.floor.locations import export_stage
    from stages.floor.registry import EXPORT_URI_TAG, RUN_ID_TAG, resolve  # (imports MLflow)
    from verl_core.runtime.tracking import default_tracking_uri

    ref = resolve(tracking_uri or default_tracking_uri(store_url, create=False), target)
    uri, run_id, source = ref.tags.get(EXPORT_URI_TAG), ref.tags.get(RUN_ID_TAG), ref.tags.get(SOURCE_TAG)
    if uri:
        run_id = uri.split("/runs/")[-1].split("/")[0]
        store = ArtifactStore(uri[: uri.rindex(f"/runs/{run_id}/")])
    elif run_id and source:
        store = ArtifactStore(store_url)
        uri = store.manifest_uri(run_id, export_stage(source))
    else:
        raise ArtifactNotFoundError(
            f"{ref.uri} has no tag {EXPORT_URI_TAG} (nor {RUN_ID_TAG} and {SOURCE_TAG}): "
            "not registered by a verl-flow export"
        )
    names = [f"{ref.name}/{ref.version}"]
    alias = target[len("models:/") :].partition("@")[2]
    if alias:
        names.append(f"{ref.name}@{alias}")
    return _export(store, store.read_manifest(uri), ref.name, names, ref.version, target)


def _export(
    store: ArtifactStore, manifest: Manifest, name: str, names: list[str], version: str | None, target: str
) -> ServedModel:
    prefix = MODEL_PREFIX + "/"
    shas = {f.name[len(prefix) :]: f.sha256 for f in manifest.files if f.name.startswith(prefix)}
    if "config.json" not in shas:
        raise ArtifactNotFoundError(f"export {manifest.stage!r} of run {manifest.run_id!r} has no model")
    digest = weights_digest(shas)
    tools = _tool_format(store, manifest.run_id)
    return ServedModel(_model_dir(store, manifest, shas), name, names, version, digest, tools, target)


def _model_dir(store: ArtifactStore, manifest: Manifest, shas: dict[str, str]) -> Path:
    """The export's model directory: in the store itself for a local store (its files sit in one
    directory), else the cache's copy (written once)."""
    if store.url.startswith("file://"):
        config = Path(store.file_uri(manifest, f"{MODEL_PREFIX}/config.json").removeprefix("file://"))
        in_place = all(
            Path(store.file_uri(manifest, f"{MODEL_PREFIX}/{rel}").removeprefix("file://"))
            == config.parent / rel
            for rel in shas
        )
        if in_place and store.files_present(manifest):
            return config.parent
    cached = records.cache_dir() / store.manifest_sha256(store.manifest_uri(manifest.run_id, manifest.stage))
    if (cached / "config.json").is_file():
        return cached  # written by an earlier serve (a copy appears whole: written beside, renamed)
    partial = cached.with_name(f".{cached.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        materialise_export(store, manifest, partial)
        cached.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # another serve finished the same copy first: use its
            os.replace(partial, cached)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return cached


def _tool_format(store: ArtifactStore, run_id: str) -> str | None:
    """The run's ``rollout.multi_turn.format`` when it trained with tools (``multi_turn.enable``)."""
    try:
        config: dict[str, Any] = store.read_run_record(run_id).config
    except (ArtifactNotFoundError, OSError):
        return None
    multi_turn = config.get("rollout", {}).get("multi_turn", {})
    return (
        multi_turn.get("format", "hermes") if multi_turn.get("enable") and multi_turn.get("tools") else None
    )


def start(
    model: ServedModel, settings: ServeConfig, *, replace: bool = False, detached: bool = False
) -> ServerHandle:
    """Start the server on ``model`` and write its record once it is ready. A name already served is
    refused unless ``replace`` (the running server is stopped first); a stale record is removed.
    On a failed start nothing is left but the log."""
    for record, alive in records.read_records(model.name):
        if alive and not replace:
            raise ServeError(
                f"{model.name} is already served at {record.url} (pid {record.pid}): "
                f"`verl-flow serve stop {model.name}` first, or --replace"
            )
        records.stop_record(record)  # stops a live one (replace), removes a stale one
    root = records.link_weights(model.name, model.model_dir, model.digest)
    log = records.record_dir(model.name) / records.LOG
    try:
        handle = start_server(
            root, settings, log, model.served_names(settings.served_model_name),
            model.tool_call_parser(settings.tool_call_parser),
        )  # fmt: skip
    except BaseException:
        records.remove_record(model.name)
        raise
    try:
        records.write_record(
            records.ServeRecord(
                name=model.name, target=model.target, pid=handle.pgid, host=settings.host, port=settings.port,
                url=handle.url, names=handle.names, version=model.version, digest=model.digest,
                model_dir=str(model.model_dir), root=str(root), log=str(log), started=records.now(),
                owner_pid=os.getpid(), detached=detached,
            )
        )  # fmt: skip
    except BaseException:  # a signal while recording: the server runs in its own session, stop it
        handle.stop()
        records.remove_record(model.name, handle.pgid)
        raise
    return handle


@contextlib.contextmanager
def serving(model: ServedModel, settings: ServeConfig, *, replace: bool = False) -> Iterator[ServerHandle]:
    """:func:`start`, and at the end of the block stop the server and remove its record (unless a
    replacement's record took its place)."""
    handle = start(model, settings, replace=replace)
    try:
        yield handle
    finally:
        handle.stop()
        records.remove_record(model.name, handle.pgid)


def replaced(model: ServedModel, handle: ServerHandle) -> bool:
    """Whether ``handle``'s server was stopped through its record (``serve stop``, a replacement)."""
    record = records.read_record(model.name)
    return record is None or record.pid != handle.pgid


class Stopped(BaseException):
    """SIGTERM / SIGHUP arrived: unwind, stopping the server on the way out."""


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (``timeout``, systemd, ``docker stop``) raise :class:`Stopped` in the main
    thread, so that ``finally`` blocks stop the server (it runs in its own session and would outlive
    us); SIGINT raises KeyboardInterrupt as always. A handler already installed is left in place:
    Prefect's flow engine turns a cancellation's SIGTERM into ``TerminationSignal``, which unwinds the
    same way (and marks the flow run Cancelled)."""
    ours = [signal.SIGTERM, signal.SIGHUP]

    def stop(signum: int, _frame: object) -> None:
        for s in ours:  # once: a second signal does not cut the cleanup short
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signal.Signals(signum).name)

    if not _main_thread():
        yield
        return
    ours = [s for s in ours if signal.getsignal(s) is signal.SIG_DFL]
    old = {s: signal.signal(s, stop) for s in ours}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@flow(name="serve-model", log_prints=True)
def serve_model(
    target: str, store_url: str, settings: ServeConfig = ServeConfig(), tracking_uri: str = ""
) -> str:
    """Serve ``target`` with vLLM's OpenAI-compatible server until the flow run is cancelled or a
    later run of this deployment replaces it (a promotion event: the new champion).

    Args:
        target: models:/NAME@ALIAS, models:/NAME/VERSION, a run id (its latest export) or a model directory.
        store_url: The store holding the run (empty: the worker's ``./runs``).
        settings: The server's settings (host, port, vLLM's rollout-section settings).
        tracking_uri: The MLflow registry of models:/ targets (empty: $MLFLOW_TRACKING_URI or the store's).
    """
    from verl_core.runtime.serving import curl_example

    model = resolve_model(target, store_url or StoreConfig().url, tracking_uri or None)  # empty: the default
    with stop_on_signals(), serving(model, settings, replace=True) as handle:
        print(
            f"serving {target} as {', '.join(handle.names)} (weights sha256 {model.digest}) at "
            f"{handle.url}/v1\n{curl_example(handle)}"
        )
        code = handle.wait()
        if replaced(model, handle):
            print(f"{model.name}: stopped by a replacement or `verl-flow serve stop` (exit code {code})")
            return f"replaced: {', '.join(handle.names)}"
    raise RuntimeError(f"the vLLM server exited with code {code}; log tail:\n{handle.log_tail()}")
