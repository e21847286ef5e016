"""Serving a run's export: ``verl-flow serve RUN_ID|DIR`` and the ``serve-model`` deployment (gpu pool).

:func:`resolve_model` turns a run id into the directory of its latest export (written out of the store
into a working directory) or takes a local model directory as it is; :func:`serve` starts vLLM's
OpenAI-compatible server on it (:func:`verl_core.runtime.serving.start_server`) and returns once it is
healthy.
:func:`serve_model` is the deployment's flow: the same two steps, then it holds the server until the
flow run is cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import flow

from stages.floor.artifacts import materialise_export
from stages.floor.locations import list_exports
from verl_core.config import StoreConfig
from verl_core.errors import ArtifactNotFoundError
from verl_core.runtime.serving import ServeConfig, ServerHandle, start_server
from verl_core.store import ArtifactStore


@dataclass(frozen=True)
class ServedModel:
    """What is served: an HF model directory and the name it is served under by default."""

    model_dir: Path
    name: str  # the run id, or the directory's name


def resolve_model(target: str, store_url: str, workdir: str | Path) -> ServedModel:
    """``target``: an HF model directory (has config.json), else a run id of the store at ``store_url``
    whose latest export (the last committed) is written under ``workdir``."""
    path = Path(target).expanduser()
    if (path / "config.json").is_file():
        return ServedModel(path.resolve(), path.resolve().name)
    store = ArtifactStore(store_url)
    if not store.list_manifests(target):
        raise ArtifactNotFoundError(
            f"{target!r} is neither a model directory (config.json) nor a run in {store_url}"
        )
    exports = list_exports(store, target)  # in commit order, as `verl-flow eval` picks
    if not exports:
        raise ArtifactNotFoundError(f"run {target!r} has no export; run `verl-flow export {target}` first")
    uri = store.manifest_uri(target, exports[-1])
    model_dir = materialise_export(store, store.read_manifest(uri), Path(workdir) / "model")
    return ServedModel(model_dir, target)


def serve(model: ServedModel, settings: ServeConfig, log_path: str | Path) -> ServerHandle:
    """Start the server on ``model`` and wait until it is healthy
    (:func:`verl_core.runtime.serving.start_server`)."""
    return start_server(model.model_dir, settings, log_path, settings.served_model_name or model.name)


@flow(name="serve-model", log_prints=True)
def serve_model(run_id: str, store_url: str, settings: ServeConfig = ServeConfig()) -> None:
    """Serve the latest export of ``run_id`` (store ``store_url``) with vLLM's OpenAI-compatible server
    until the flow run is cancelled.

    Args:
        run_id: The run whose latest export is served.
        store_url: The store holding the run (empty: the worker's ``./runs``).
        settings: The server's settings (host, port, vLLM's rollout-section settings).
    """
    import tempfile

    from verl_core.runtime.serving import curl_example

    with tempfile.TemporaryDirectory(prefix="verl-flow-serve-") as tmp:
        model = resolve_model(run_id, store_url or StoreConfig().url, tmp)  # empty: as every flow's store
        with serve(model, settings, Path(tmp) / "server.log") as handle:
            print(f"serving {handle.model} at {handle.url}/v1\n{curl_example(handle)}")
            code = handle.wait()
        raise RuntimeError(f"the vLLM server exited with code {code}; log tail:\n{handle.log_tail()}")
