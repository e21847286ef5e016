"""Artifact store: round trips, schemas, commit protocol, skip on rerun, killed writers, isolation.

Runs against memory://, a local directory and a real S3-compatible HTTP endpoint (moto server on
127.0.0.1)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_core.errors import ArtifactCorruptError, ArtifactNotFoundError, ArtifactSchemaError, StoreFullError
from verl_core.store import ArtifactStore, get_schema, normalize_url, register_schema
from verl_core.store.schemas import TOKEN_FLOATS, TOKEN_IDS

register_schema(
    "test_tokens",
    pa.schema([("index", pa.int64()), ("ids", TOKEN_IDS), ("logp", TOKEN_FLOATS)]),
)


def tokens_table(n: int, offset: int = 0) -> pa.Table:
    return pa.table(
        {
            "index": pa.array([offset + i for i in range(n)], pa.int64()),
            "ids": pa.array([[i, i + 1, i + 2][: 1 + i % 3] for i in range(n)], TOKEN_IDS),
            "logp": pa.array([[-0.5] * (1 + i % 3) for i in range(n)], TOKEN_FLOATS),
        }
    )


@pytest.fixture(params=["memory", "local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://store-{uuid.uuid4().hex[:8]}"
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_bucket") + "/prefix"


def test_write_commit_read_roundtrip(store_url: str) -> None:
    store = ArtifactStore(store_url)
    stage = store.open_stage("run-a", "preprocess", params={"seed": 1})
    assert not stage.done
    table = tokens_table(5)
    stage.write_table("prompts/train.parquet", table, kind="test_tokens")
    stage.write_json("report.json", {"kept": 5, "dropped": {"empty": 2}})
    uri = stage.commit(summary={"rows": 5})

    assert uri == store.manifest_uri("run-a", "preprocess")
    manifest = store.read_manifest(uri)
    assert [f.name for f in manifest.files] == ["prompts/train.parquet", "report.json"]
    assert manifest.file("prompts/train.parquet").rows == 5
    assert manifest.summary == {"rows": 5}
    back = store.read_table(manifest, "prompts/train.parquet")
    assert back.equals(table)
    # token ids are list<int32>, per-token floats list<float32>
    assert back.schema.field("ids").type == pa.list_(pa.int32())
    assert back.schema.field("logp").type == pa.list_(pa.float32())
    assert json.loads(store.read_bytes(manifest, "report.json")) == {"kept": 5, "dropped": {"empty": 2}}


def test_parquet_is_zstd_and_readable_by_plain_pyarrow(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    stage = store.open_stage("r", "s")
    stage.write_table("t.parquet", tokens_table(3), kind="test_tokens")
    manifest = store.read_manifest(stage.commit())
    path = store.file_uri(manifest, "t.parquet")[len("file://") :]
    meta = pq.ParquetFile(path).metadata
    assert meta.row_group(0).column(0).compression == "ZSTD"
    assert pq.read_table(path).num_rows == 3


def test_rerun_with_same_inputs_is_skipped_and_changed_params_rerun(store_url: str) -> None:
    store = ArtifactStore(store_url)
    first = store.open_stage("r", "preprocess", params={"seed": 1})
    first.write_table("t.parquet", tokens_table(2), kind="test_tokens")
    first.commit()

    again = store.open_stage("r", "preprocess", params={"seed": 1})
    assert again.done and again.manifest is not None
    assert again.manifest.attempt == first.attempt

    changed = store.open_stage("r", "preprocess", params={"seed": 2})
    assert not changed.done
    changed.write_table("t.parquet", tokens_table(4), kind="test_tokens")
    changed.commit()
    manifest = store.committed("r", "preprocess")
    assert manifest is not None and manifest.file("t.parquet").rows == 4
    # the old attempt's files are gone after the new commit
    stage_dir = store.path("runs", "r", "preprocess")
    attempts = [p for p in store.fs.ls(stage_dir, detail=False) if "attempt-" in p]
    assert len(attempts) == 1 and attempts[0].rstrip("/").endswith(changed.attempt)


def test_downstream_reruns_when_upstream_manifest_changes(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    up = store.open_stage("r", "up", params={"v": 1})
    up.write_table("t.parquet", tokens_table(2), kind="test_tokens")
    up_uri = up.commit()
    down = store.open_stage("r", "down", inputs={"up": up_uri})
    down.write_json("x.json", {})
    down.commit()
    assert store.open_stage("r", "down", inputs={"up": up_uri}).done

    up2 = store.open_stage("r", "up", params={"v": 2})
    up2.write_table("t.parquet", tokens_table(3), kind="test_tokens")
    up2.commit()
    # same URI, different manifest bytes: the input hash differs, so downstream must run again
    assert not store.open_stage("r", "down", inputs={"up": up_uri}).done


def test_schema_enforced_on_write_with_field_named(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    stage = store.open_stage("r", "s")
    bad = pa.table({"index": [1], "ids": [["a"]], "logp": [[0.1]]})
    with pytest.raises(ArtifactSchemaError, match=r"field 'ids'.*expected list<item: int32>"):
        stage.write_table("t.parquet", bad, kind="test_tokens")
    missing = pa.table({"index": [1], "ids": [[1]]})
    with pytest.raises(ArtifactSchemaError, match=r"missing field.*logp"):
        stage.write_table("t.parquet", missing, kind="test_tokens")
    with pytest.raises(ArtifactSchemaError, match="unknown artifact kind 'nope'; known kinds:"):
        stage.write_table("t.parquet", tokens_table(1), kind="nope")
    # int64 ids that fit are cast safely to int32
    widened = pa.table({"index": [1], "ids": pa.array([[1, 2]], pa.list_(pa.int64())), "logp": [[0.1, 0.2]]})
    entry = stage.write_table("t.parquet", widened, kind="test_tokens")
    assert entry.rows == 1


def test_reader_detects_tampered_file_and_wrong_schema(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    stage = store.open_stage("r", "s")
    stage.write_table("t.parquet", tokens_table(3), kind="test_tokens")
    manifest = store.read_manifest(stage.commit())
    path = store.file_uri(manifest, "t.parquet")[len("file://") :]

    other = pa.table({"index": [1, 2, 3]})
    pq.write_table(other, path)
    with pytest.raises(ArtifactCorruptError, match=r"t\.parquet: content does not match its manifest"):
        store.read_table(manifest, "t.parquet")


def test_missing_artifacts_name_what_exists(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    stage = store.open_stage("r", "s")
    stage.write_json("a.json", {})
    manifest = store.read_manifest(stage.commit())
    with pytest.raises(ArtifactNotFoundError, match=r"no artifact 'b\.json' \(it has: a\.json\)"):
        store.read_bytes(manifest, "b.json")
    with pytest.raises(ArtifactNotFoundError, match="does not exist"):
        store.read_manifest(store.manifest_uri("r", "never"))


def test_corrupt_manifest_is_named(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    uri = store.manifest_uri("r", "s")
    Path(uri[len("file://") :]).parent.mkdir(parents=True)
    Path(uri[len("file://") :]).write_text('{"run_id": "r"')
    with pytest.raises(ArtifactCorruptError, match=r"manifest\.json: not a valid manifest"):
        store.read_manifest(uri)


def test_deleted_file_makes_stage_run_again(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    stage = store.open_stage("r", "s")
    stage.write_json("a.json", {"x": 1})
    manifest = store.read_manifest(stage.commit())
    os.remove(store.file_uri(manifest, "a.json")[len("file://") :])
    assert not store.open_stage("r", "s").done


def test_two_runs_under_one_bucket_are_isolated(s3_bucket: str) -> None:
    a = ArtifactStore(s3_bucket + "/team")
    b = ArtifactStore(s3_bucket + "/team")
    for store, run, n in ((a, "run-a", 2), (b, "run-b", 7)):
        store.write_run_record(run, {"n": n}, config_hash=str(n))
        stage = store.open_stage(run, "preprocess", params={"seed": 1})
        stage.write_table("t.parquet", tokens_table(n), kind="test_tokens")
        stage.commit()
    assert a.list_runs() == ["run-a", "run-b"]
    ma, mb = a.committed("run-a", "preprocess"), a.committed("run-b", "preprocess")
    assert ma is not None and mb is not None
    assert a.read_table(ma, "t.parquet").num_rows == 2
    assert a.read_table(mb, "t.parquet").num_rows == 7
    # same stage, same params, different runs: separate manifests and separate files
    assert ma.input_key == mb.input_key
    assert a.file_uri(ma, "t.parquet") != a.file_uri(mb, "t.parquet")
    assert [m.stage for m in a.list_manifests("run-a")] == ["preprocess"]


WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import pyarrow as pa
    from verl_core.store import ArtifactStore, register_schema
    from verl_core.store.schemas import TOKEN_IDS, TOKEN_FLOATS
    fields = [("index", pa.int64()), ("ids", TOKEN_IDS), ("logp", TOKEN_FLOATS)]
    register_schema("test_tokens", pa.schema(fields))
    store = ArtifactStore(sys.argv[1])
    stage = store.open_stage("run-k", "rollout", params={"seed": 1})
    t = pa.table({"index": pa.array([0, 1], pa.int64()), "ids": pa.array([[1], [2, 3]], TOKEN_IDS),
                  "logp": pa.array([[-1.0], [-1.0, -2.0]], TOKEN_FLOATS)})
    stage.write_table("rollouts-0.parquet", t, kind="test_tokens")
    stage.write_table("rollouts-1.parquet", t, kind="test_tokens")
    print(stage.attempt, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # killed between the data files and the manifest
    stage.commit()
    """
)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_writer_killed_before_manifest_leaves_nothing_visible(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = str(tmp_path / "store") if backend == "local" else request.getfixturevalue("s3_bucket")
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, url],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    dead_attempt = proc.stdout.strip()
    store = ArtifactStore(url)
    # the data files exist under the dead attempt, but no manifest: nothing is visible to readers
    stage_dir = store.path("runs", "run-k", "rollout")
    assert any(dead_attempt in p for p in store.fs.find(stage_dir))
    assert store.committed("run-k", "rollout") is None
    assert store.list_manifests("run-k") == []

    # a rerun does the work, commits, and the dead attempt is cleaned up
    rerun = store.open_stage("run-k", "rollout", params={"seed": 1})
    assert not rerun.done
    rerun.write_table("rollouts-0.parquet", tokens_table(2), kind="test_tokens")
    uri = rerun.commit()
    manifest = store.read_manifest(uri)
    assert store.read_table(manifest, "rollouts-0.parquet").num_rows == 2
    assert not any(dead_attempt in p for p in store.fs.find(stage_dir))


def test_local_paths_normalise_to_file_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert normalize_url("runs") == (tmp_path / "runs").as_uri()
    assert normalize_url("file://runs/") == (tmp_path / "runs").as_uri()
    assert normalize_url("s3://bucket/prefix/") == "s3://bucket/prefix"


def test_run_record_keeps_created_and_updates_hash(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    first = store.write_run_record("r", {"a": 1}, "h1")
    second = store.write_run_record("r", {"a": 2}, "h2")
    assert second.created_at == first.created_at
    rec = store.read_run_record("r")
    assert rec.config == {"a": 2} and rec.config_hash == "h2" and rec.code_version.startswith("0.1.0")


def test_invalid_names_are_refused(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    with pytest.raises(Exception, match="invalid run_id"):
        store.open_stage("../escape", "s")
    stage = store.open_stage("r", "s")
    with pytest.raises(Exception, match="invalid artifact name"):
        stage.write_json("../x.json", {})


def test_registered_schemas_use_narrow_token_types() -> None:
    assert get_schema("test_tokens").field("ids").type == pa.list_(pa.int32())


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_is_one_error_naming_the_store_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    store = ArtifactStore(str(tmp_path))
    path = store.path("runs", "r", "stage", "attempt-1", "big.bin")

    def full(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StoreFullError) as e:
        store.put_atomic(path, b"x" * 10)
    where = "runs/r/stage/attempt-1/big.bin"
    assert str(e.value).startswith(
        f"store file://{tmp_path}: no space left on the device writing {where} (10 bytes)"
    )
    assert os.listdir(os.path.dirname(path)) == []  # the temporary copy is gone, nothing renamed into place


def test_other_write_errors_are_not_called_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(str(tmp_path))

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError) as e:
        store.put_atomic(store.path("runs", "r", "f.bin"), b"x")
    assert e.value.errno == errno.EIO and not isinstance(e.value, StoreFullError)


def test_streamed_files_commit_and_read_back_checked(store_url: str, tmp_path: Path) -> None:
    # trainer state and weights go in as local files, never one bytes object: staged_file gives the
    # path to write, write_bytes takes a path too; the manifest holds the content's size and sha256
    store = ArtifactStore(store_url)
    stage = store.open_stage("run-a", "ckpt/iter-0001")
    state, weights = os.urandom(300_000), os.urandom(1000)
    with stage.staged_file("trainer_state.pt") as path:
        path.write_bytes(state)
    (tmp_path / "model.safetensors").write_bytes(weights)
    stage.write_bytes("critic/model.safetensors", tmp_path / "model.safetensors")
    assert not path.exists()  # the staged file is in the store now, its staging name gone
    manifest = store.read_manifest(stage.commit())

    entry = manifest.file("trainer_state.pt")
    assert (entry.size, entry.sha256) == (len(state), hashlib.sha256(state).hexdigest())
    assert store.read_bytes(manifest, "critic/model.safetensors") == weights
    with store.local_file(manifest, "trainer_state.pt") as local:
        assert local.read_bytes() == state
    assert store.files_present(manifest)
    if store._local:  # the store's own file, read in place; nothing but the committed files in the attempt
        assert local.exists()
        attempt = Path(store.path("runs", "run-a", "ckpt/iter-0001", manifest.attempt))
        assert sorted(str(p.relative_to(attempt)) for p in attempt.rglob("*") if p.is_file()) == [
            "critic/model.safetensors",
            "trainer_state.pt",
        ]
    else:  # a temporary download, removed on exit
        assert not local.exists()


def test_a_streamed_file_is_checked_against_its_manifest(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    stage = store.open_stage("r", "ckpt")
    with stage.staged_file("trainer_state.pt") as path:
        path.write_bytes(b"x" * 100)
    manifest = store.read_manifest(stage.commit())
    on_disk = Path(store.path("runs", "r", "ckpt", manifest.file("trainer_state.pt").path))
    on_disk.write_bytes(b"y" * 100)  # same size, other content
    with (
        pytest.raises(ArtifactCorruptError, match="content does not match its manifest"),
        store.local_file(manifest, "trainer_state.pt"),
    ):
        pass
    on_disk.unlink()
    with pytest.raises(ArtifactNotFoundError), store.local_file(manifest, "trainer_state.pt"):
        pass


def test_a_failed_staged_write_records_nothing(store_url: str) -> None:
    store = ArtifactStore(store_url)
    stage = store.open_stage("r", "ckpt")
    with pytest.raises(RuntimeError, match="serialiser died"), stage.staged_file("trainer_state.pt") as path:
        path.write_bytes(b"half")
        raise RuntimeError("serialiser died")
    assert not path.exists()
    manifest = store.read_manifest(stage.commit())
    assert manifest.files == []


def test_a_full_disk_writing_a_streamed_file_is_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    stage = store.open_stage("r", "ckpt")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with (
        pytest.raises(StoreFullError, match=r"writing runs/r/ckpt/attempt-.*/trainer_state\.pt \(10 bytes\)"),
        stage.staged_file("trainer_state.pt") as path,
    ):
        path.write_bytes(b"x" * 10)
    attempt = Path(store.path("runs", "r", "ckpt", stage.attempt))
    assert list(attempt.iterdir()) == []  # neither the staged file nor the linked copy is left
