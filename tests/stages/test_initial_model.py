"""stages.floor.initial_model: ``model.path`` naming an export by its store URI is fetched once into
this machine's cache (named by the manifest's sha256) and reused; two fetches at once make one copy; a
missing or damaged export fails naming the URI and leaves nothing half-written in the cache. The
store is S3 (moto), as a team's is; the export holds small stand-in files (nothing loads them here)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from stages.floor import initial_model
from stages.floor.initial_model import cached_export, fetch_initial_model, is_store_uri, model_dir
from verl_core.config import load_config
from verl_core.errors import ArtifactError, ConfigError
from verl_core.store import ArtifactStore

pytestmark = pytest.mark.s3
FILES = {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": b"weights", "tokenizer.json": b"{}"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty champion cache and no export fetched by this process yet."""
    monkeypatch.setattr(initial_model, "CHAMPION_CACHE", tmp_path / "cache")
    monkeypatch.setattr(initial_model, "_FETCHED", {})
    monkeypatch.setattr(initial_model, "_ENTRY_STORE", [])
    return tmp_path / "cache"


def _export(store: ArtifactStore, run_id: str, files: dict[str, bytes] = FILES) -> str:
    stage = store.open_stage(run_id, "export/iter-0001", params={})
    for name, data in files.items():
        stage.write_bytes(f"model/{name}", data)
    return stage.commit(summary={})


def _listing(cache: Path) -> list[str]:
    """What the cache holds besides its lock files."""
    return sorted(p.name for p in cache.iterdir() if p.name != ".locks") if cache.exists() else []


def test_store_uris_and_everything_else() -> None:
    assert is_store_uri("s3://bkt/team/runs/r/export/iter-0001/manifest.json")
    assert is_store_uri("memory://x/manifest.json")
    for other in ("Qwen/Qwen2.5-0.5B-Instruct", "/models/base", "file:///store/runs/r/export/model", None):
        assert not is_store_uri(other)
        if other is not None:
            assert model_dir(other) == other  # a hub id or a directory is loaded as given


def test_a_store_uri_is_fetched_once_and_reused(s3_bucket: str, cache: Path) -> None:
    store = ArtifactStore(f"{s3_bucket}/team")
    uri = _export(store, "night1")
    cfg = load_config(None, [f"store.url={store.url}", "model.init=pretrained", f"model.path={uri}"])
    with pytest.raises(ConfigError, match=f"model.path {uri}: .* not fetched"):
        model_dir(uri)  # a loader in a process whose entry did not fetch it: one line, not transformers'

    local = fetch_initial_model(cfg)
    assert local is not None and model_dir(uri) == local
    # the directory is named by the manifest's sha256 and holds the export's model/ files, as stored
    assert Path(local) == cache / store.manifest_sha256(uri)
    assert {p.name: p.read_bytes() for p in Path(local).iterdir()} == FILES
    assert _listing(cache) == [Path(local).name]  # no partial copy beside it

    # a second fetch (another flow on this worker) reuses the copy: it reads the manifest only
    (Path(local) / "model.safetensors").write_bytes(b"marked")
    assert fetch_initial_model(cfg) == local
    assert (Path(local) / "model.safetensors").read_bytes() == b"marked"
    # the config itself still names the URI (run.json, stage keys); a scratch model fetches nothing
    assert cfg.model.path == uri
    scratch = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init": "scratch"})})
    assert fetch_initial_model(scratch) is None
    # another export of the entry's store (a fork's reference: its root's initial model) on first use
    other = _export(store, "night0", {**FILES, "model.safetensors": b"older"})
    assert Path(model_dir(other)) == cache / store.manifest_sha256(other)
    assert _listing(cache) == sorted([Path(local).name, store.manifest_sha256(other)])


def test_two_fetches_at_once_make_one_copy(
    s3_bucket: str, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two flows on one worker fetch at the same time: the lock lets one copy it, the other waits and
    reuses it (the export's files are read from the store once)."""
    store = ArtifactStore(f"{s3_bucket}/team")
    uri = _export(store, "night1")
    reads = []
    real = store.read_bytes

    def counted(*args: Any) -> bytes:  # slow enough that the second fetch comes during the first
        reads.append(args[1])
        time.sleep(0.1)
        return real(*args)

    monkeypatch.setattr(store, "read_bytes", counted)
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(cached_export(store, uri))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] == got[1]
    assert sorted(reads) == [f"model/{n}" for n in sorted(FILES)]  # each file read once
    assert _listing(cache) == [got[0].name]


def test_a_missing_export_fails_naming_the_uri(s3_bucket: str, cache: Path) -> None:
    store = ArtifactStore(f"{s3_bucket}/team")
    uri = store.manifest_uri("gone", "export/iter-0001")
    cfg = load_config(None, [f"store.url={store.url}", "model.init=pretrained", f"model.path={uri}"])
    with pytest.raises(ArtifactError, match=f"model.path {uri}: the export cannot be read"):
        fetch_initial_model(cfg)
    assert _listing(cache) == []


def test_a_damaged_export_fails_naming_the_uri_and_leaves_no_partial_copy(
    s3_bucket: str, cache: Path
) -> None:
    """A file changed after commit (its sha256 no longer the manifest's): refused while copying, and
    the half-written copy is removed; an export without config.json is no model either."""
    import fsspec

    from verl_core.store import storage_options

    store = ArtifactStore(f"{s3_bucket}/team")
    uri = _export(store, "night1")
    weights = store.file_uri(store.read_manifest(uri), "model/model.safetensors")
    fs, path = fsspec.core.url_to_fs(weights, **storage_options(weights))
    fs.pipe_file(path, b"WEIGHTS")  # same size, other bytes
    with pytest.raises(ArtifactError, match=f"model.path {uri}: the export cannot be copied here .*sha256"):
        cached_export(store, uri)
    assert _listing(cache) == []

    no_config = _export(store, "night2", {"model.safetensors": b"weights"})
    with pytest.raises(ArtifactError, match=f"model.path {no_config}: the export holds no model/config.json"):
        cached_export(store, no_config)
    assert _listing(cache) == []
