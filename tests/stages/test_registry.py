"""stages.floor.registry: champion / previous-champion aliases, decisions as version tags, rollback,
``models:/`` URIs, the promoted event. Versions are registered straight through MlflowClient with
fake sources (no model files: the registry never reads them)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from stages.floor import registry
from stages.floor.registry import CHAMPION, PREVIOUS, RegistryError
from verl_core.config import load_config
from verl_core.errors import ConfigError

_names = itertools.count()


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite tracking store for the module (creating its tables takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def no_prefect_api(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No Prefect API configured (no profile either): emit_promoted only logs."""
    monkeypatch.setenv("PREFECT_API_URL", "")
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))


def _model(uri: str, n_versions: int) -> str:
    """A new registered model with ``n_versions`` versions (1..n), each from its own MLflow run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    name = f"m{next(_names)}"
    client.create_registered_model(name)
    exp = client.get_experiment_by_name("registry") or client.get_experiment(
        client.create_experiment("registry")
    )
    for i in range(n_versions):
        run = client.create_run(exp.experiment_id).info.run_id
        client.create_model_version(
            name, source=f"/fake/{name}/{i}", run_id=run, tags={"verl_flow.run_id": f"r{i}"}
        )
    return name


def _aliases(uri: str, name: str) -> dict[str, str]:
    return {a: r.version for r in registry.versions(uri, name) for a in r.aliases}


def test_registered_name_default_and_override() -> None:
    cfg = load_config("configs/quickstart.yaml")
    t = cfg.trainer
    assert registry.registered_name(cfg) == f"{t.project_name}-{t.experiment_name}"
    named = cfg.model_copy(update={"export": cfg.export.model_copy(update={"registered_model_name": "mine"})})
    assert registry.registered_name(named) == "mine"
    # a derived name with characters MLflow refuses (configs/scale_0.5b_cpu.yaml's experiment): each as "_"
    scale = load_config("configs/scale_0.5b_cpu.yaml")
    assert registry.registered_name(scale) == "verl-flow-scale-0_5b-cpu"


@pytest.mark.parametrize("name", ["a.b", "team/model", "x:y", " "])
def test_a_registered_model_name_mlflow_refuses_is_refused_at_load(name: str) -> None:
    with pytest.raises(ConfigError, match=r"export\.registered_model_name: got .*MLflow accepts"):
        load_config("configs/quickstart.yaml", [f"export.registered_model_name={name}"])


def test_promote_moves_champion_and_previous(uri: str) -> None:
    name = _model(uri, 3)
    assert registry.champion(uri, name) is None
    registry.promote(uri, name, "1", decision={"verdict": "pass", "reason": "floor passed"}, by="gate")
    assert _aliases(uri, name) == {CHAMPION: "1"}  # first champion: no previous
    registry.promote(uri, name, "2", decision={"verdict": "pass", "p-value": 0.01}, by="gate")
    assert _aliases(uri, name) == {CHAMPION: "2", PREVIOUS: "1"}
    champ = registry.champion(uri, name)
    assert champ is not None and champ.version == "2" and champ.mlflow_run_id
    # the decision as tags: dash → underscore, floats JSON, by and time added
    assert champ.decision["p_value"] == "0.01" and champ.decision["by"] == "gate" and champ.decision["time"]
    registry.promote(uri, name, "3", decision={"verdict": "pass"}, by="hand")
    assert _aliases(uri, name) == {CHAMPION: "3", PREVIOUS: "2"}
    # promoting the champion again moves nothing
    registry.promote(uri, name, "3", decision={"verdict": "pass"}, by="hand")
    assert _aliases(uri, name) == {CHAMPION: "3", PREVIOUS: "2"}


def test_record_decision_replaces_the_previous_decision(uri: str) -> None:
    name = _model(uri, 1)
    registry.record_decision(
        uri, name, "1", {"verdict": "reject", "reason": "worse", "p_value": 0.9, "by": "gate"}
    )
    registry.record_decision(uri, name, "1", {"verdict": "pass", "by": "hand"})
    (ref,) = registry.versions(uri, name)
    assert set(ref.decision) == {"verdict", "by", "time"} and ref.decision["verdict"] == "pass"
    assert ref.tags["verl_flow.run_id"] == "r0"  # lineage tags untouched
    assert ref.aliases == ()  # tags only


def test_rollback_restores_previous_and_records_it(uri: str) -> None:
    name = _model(uri, 2)
    with pytest.raises(RegistryError, match="has no 'champion' alias"):
        registry.rollback(uri, name)
    registry.promote(uri, name, "1", decision={"verdict": "pass"}, by="gate")
    with pytest.raises(RegistryError, match="has no 'previous-champion' alias"):
        registry.rollback(uri, name)
    registry.promote(uri, name, "2", decision={"verdict": "pass"}, by="gate")
    restored = registry.rollback(uri, name)
    assert restored.version == "1" and restored.decision["by"] == "rollback"
    assert "from version 2" in restored.decision["reason"]
    assert _aliases(uri, name) == {CHAMPION: "1"}  # previous-champion consumed: no rollback loop
    demoted = registry.resolve(uri, f"models:/{name}/2")
    assert demoted.tags[registry.ROLLED_BACK_TAG].endswith("to version 1")
    assert demoted.decision["by"] == "gate"  # its own decision is kept


def test_resolve_uris_and_clear_errors(uri: str) -> None:
    name = _model(uri, 2)
    registry.promote(uri, name, "2", decision={"verdict": "pass"}, by="gate")
    assert registry.resolve(uri, f"models:/{name}@champion").version == "2"
    assert registry.resolve(uri, f"models:/{name}/1").version == "1"
    with pytest.raises(RegistryError, match=r"no alias 'staging' \(aliases: champion→2\)"):
        registry.resolve(uri, f"models:/{name}@staging")
    with pytest.raises(RegistryError, match=r"no version 9 \(versions: 1, 2\)"):
        registry.resolve(uri, f"models:/{name}/9")
    with pytest.raises(RegistryError, match="no registered model 'absent'"):
        registry.resolve(uri, "models:/absent@champion")
    with pytest.raises(RegistryError, match="expected models:/NAME@ALIAS"):
        registry.resolve(uri, f"runs:/{name}")
    with pytest.raises(RegistryError, match="no version 5"):
        registry.promote(uri, name, "5", decision={}, by="hand")


def test_model_names_lists_only_verl_flow_models(uri: str) -> None:
    from mlflow.tracking import MlflowClient

    name = _model(uri, 1)
    MlflowClient(tracking_uri=uri).create_registered_model(f"other{name}")
    names = registry.model_names(uri)
    assert name in names and f"other{name}" not in names


def test_promoted_event_payload(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a Prefect API configured the event carries name/version/previous/by; without one, none is
    sent (only logged)."""
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(
        registry, "emit_promoted", lambda *a: sent.append(dict(zip(["n", "v", "p", "by"], a, strict=True)))
    )
    name = _model(uri, 2)
    registry.promote(uri, name, "1", decision={}, by="gate")
    registry.promote(uri, name, "2", decision={}, by="hand")
    registry.rollback(uri, name)
    assert sent == [
        {"n": name, "v": "1", "p": None, "by": "gate"},
        {"n": name, "v": "2", "p": "1", "by": "hand"},
        {"n": name, "v": "1", "p": "2", "by": "rollback"},
    ]


def test_emit_promoted_needs_a_configured_api(monkeypatch: pytest.MonkeyPatch) -> None:
    import prefect.events
    from prefect.events.worker import EventsWorker

    emitted: list[dict[str, Any]] = []

    def emit_event(event: str, **kw: Any) -> object:
        emitted.append({"event": event, **kw})
        return object()  # Prefect returns the Event it queued

    monkeypatch.setattr(prefect.events, "emit_event", emit_event)
    monkeypatch.setattr(EventsWorker, "drain_all", classmethod(lambda cls, **kw: None))
    assert registry.emit_promoted("m", "2", "1", "hand") is None and emitted == []  # no API: nothing sent
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    sent = registry.emit_promoted("m", "2", None, "gate")
    assert sent is not None and emitted == [{"event": "verl-flow.model.promoted", **sent}]
    assert sent["resource"]["prefect.resource.id"] == "verl-flow.model.m"
    assert sent["payload"] == {
        "name": "m",
        "version": "2",
        "previous": "",
        "by": "gate",
        "model_uri": "models:/m/2",
    }


def _config(tmp_path: Path, uri: str, name: str, start_from: str) -> Any:
    overrides = [f"store.url={tmp_path / 'store'}", f"tracking.uri={uri}", f"retrain.start_from={start_from}"]
    return load_config("configs/quickstart.yaml", [*overrides, f"export.registered_model_name={name}"])


def test_start_from_config_records_only_a_snapshot(tmp_path: Path, uri: str) -> None:
    cfg = _config(tmp_path, uri, "unused", "config")
    assert registry.start_from(cfg, None) == (cfg, None)  # run.json as it always was
    assert registry.start_from(cfg, "/snap/2026-11-28") == (
        cfg,
        {"start_from": "config", "data_snapshot": "/snap/2026-11-28"},
    )


def test_start_from_champion_uses_its_export(tmp_path: Path, uri: str) -> None:
    """No champion: the config's model (night 1). A champion: its export dir in the store is the
    initial model, pretrained, no SFT; the origin names the version and the snapshot."""
    from mlflow.tracking import MlflowClient

    from verl_core.store import ArtifactStore

    name = _model(uri, 0)
    cfg = _config(tmp_path, uri, name, "champion")
    same, origin = registry.start_from(cfg, "/snap/1")
    assert same == cfg and origin == {
        "start_from": "config",
        "reason": f"no champion of {name} yet",
        "data_snapshot": "/snap/1",
    }
    store = ArtifactStore(cfg.store.url)
    stage = store.open_stage("night1", "export/iter-0002", params={})
    stage.write_bytes("model/config.json", b"{}")
    export_uri = stage.commit(summary={})
    client = MlflowClient(tracking_uri=uri)
    tags = {"verl_flow.run_id": "night1", "verl_flow.source_stage": "ckpt/iter-0002"}
    client.create_model_version(name, source="/fake", tags=tags)
    registry.promote(uri, name, "1", decision={"verdict": "pass"}, by="gate")

    started, origin = registry.start_from(cfg, "/snap/2")
    model_dir = Path(store.file_uri(store.read_manifest(export_uri), "model/config.json")[7:]).parent
    assert (started.model.path, started.model.init, started.sft.enable) == (
        str(model_dir),
        "pretrained",
        False,
    )
    assert origin is not None and origin["model_uri"] == f"models:/{name}/1"
    assert (origin["start_from"], origin["run_id"], origin["export_uri"]) == (
        "champion",
        "night1",
        export_uri,
    )
    assert origin["data_snapshot"] == "/snap/2"
    # run.json keeps it (and a record written without one has no origin key at all)
    store.write_run_record("night2", {}, "h", origin)
    assert store.read_run_record("night2").origin == origin
    store.write_run_record("plain", {}, "h")
    assert "origin" not in (Path(str(tmp_path / "store")) / "runs" / "plain" / "run.json").read_text()


def test_start_from_a_champion_in_a_remote_store(
    tmp_path: Path, uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export in a store that is not a local directory (memory:// stands for S3): copied once under
    the champion cache in local mode (a second start reuses the copy); in deployments mode the config
    names it by its URI, which each process fetches at its entry (tests/stages/test_initial_model.py)."""
    from mlflow.tracking import MlflowClient

    from stages.floor import initial_model
    from verl_core.store import ArtifactStore

    monkeypatch.setattr(initial_model, "CHAMPION_CACHE", tmp_path / "cache")
    name = _model(uri, 0)
    store = ArtifactStore(f"memory://champ-{name}")
    stage = store.open_stage("night1", "export/iter-0001", params={})
    stage.write_bytes("model/config.json", b'{"a": 1}')
    stage.write_bytes("model/model.safetensors", b"weights")
    export_uri = stage.commit(summary={})
    tags = {"verl_flow.run_id": "night1", "verl_flow.export_uri": export_uri}
    MlflowClient(tracking_uri=uri).create_model_version(name, source="/fake", tags=tags)
    registry.promote(uri, name, "1", decision={"verdict": "pass"}, by="gate")
    cfg = load_config(None, [f"store.url={store.url}", f"tracking.uri={uri}", "retrain.start_from=champion"])
    cfg = cfg.model_copy(update={"export": cfg.export.model_copy(update={"registered_model_name": name})})

    started, origin = registry.start_from(cfg, None)
    local = Path(str(started.model.path))
    assert local.parent == tmp_path / "cache" and (local / "model.safetensors").read_bytes() == b"weights"
    assert origin is not None and origin["export_uri"] == export_uri and origin["model_path"] == str(local)
    copies = [p.name for p in (tmp_path / "cache").iterdir() if p.name != ".locks"]
    assert copies == [local.name]  # no partial copy left
    assert registry.start_from(cfg, None)[0].model.path == str(local)  # the same copy again


@pytest.mark.s3
def test_start_from_a_champion_in_s3_in_deployments_mode(uri: str, s3_bucket: str) -> None:
    """Deployments mode with an S3 store: no refusal, nothing copied here; the config names the export
    by its URI (each process fetches it at its entry: tests/stages/test_initial_model.py, and
    tests/flows/test_champion_deployments.py for the pipeline and the gpu pool's flows)."""
    from mlflow.tracking import MlflowClient

    from verl_core.store import ArtifactStore

    name = _model(uri, 0)
    store = ArtifactStore(f"{s3_bucket}/team")
    stage = store.open_stage("night1", "export/iter-0001", params={})
    stage.write_bytes("model/config.json", b'{"a": 1}')
    export_uri = stage.commit(summary={})
    tags = {"verl_flow.run_id": "night1", "verl_flow.export_uri": export_uri}
    MlflowClient(tracking_uri=uri).create_model_version(name, source="/fake", tags=tags)
    registry.promote(uri, name, "1", decision={"verdict": "pass"}, by="gate")
    deployed = ["execution.mode=deployments", "execution.shared_filesystem=true"]  # the sqlite MLflow
    overrides = [f"store.url={store.url}", f"tracking.uri={uri}", "retrain.start_from=champion", *deployed]
    cfg = load_config(None, [*overrides, f"export.registered_model_name={name}"])

    started, origin = registry.start_from(cfg, "/snap/3")
    assert (started.model.path, started.model.init, started.sft.enable) == (export_uri, "pretrained", False)
    assert origin == {
        "start_from": "champion",
        "model_uri": f"models:/{name}/1",
        "mlflow_run_id": None,
        "run_id": "night1",
        "export_uri": export_uri,
        "model_path": export_uri,
        "data_snapshot": "/snap/3",
    }
