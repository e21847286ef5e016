"""An export's registered version, as MLflow users load it: with MLflow's own API only
(``mlflow.transformers.load_model``, ``mlflow.pyfunc.load_model``, ``models:/NAME/VERSION`` and
``models:/NAME@alias`` URIs), not our readers; and the model card the export writes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from stages.export import export_model
from stages.floor.locations import template_pack_uri
from tests.stages.test_export import _checkpoint, _run

NAME = "verl-flow-export-test"  # {trainer.project_name}-{trainer.experiment_name} of test_export's TINY


@pytest.fixture
def fluent_uri(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """MLflow's loaders resolve ``models:/`` through the process-wide tracking URI: reset after."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # restored on teardown
    yield
    mlflow.set_tracking_uri(None)


def test_registered_version_loads_and_generates_with_mlflows_own_loaders(
    tmp_path: Path, fluent_uri: None
) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    ctx, cfg = _run(tmp_path, "mlflow-load", 0)
    _checkpoint(ctx, cfg, 1)
    store = ctx.store()
    uri = export_model.fn(ctx, cfg, template_pack_uri(store, ctx.run_id), 1)
    m = store.read_manifest(uri)
    reg = m.summary["registered_model"]
    assert reg["name"] == NAME

    # the version: the run that logged it, the lineage tags, the export's manifest URI to find it by
    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    version = client.get_model_version(NAME, reg["version"])
    assert version.run_id == ctx.mlflow_run_id
    assert version.tags["verl_flow.export_uri"] == uri
    assert version.tags["verl_flow.run_id"] == ctx.run_id and version.tags["verl_flow.iteration"] == "1"
    client.set_registered_model_alias(NAME, "champion", reg["version"])

    mlflow.set_tracking_uri(ctx.tracking_uri)
    # the transformers flavour: a text-generation pipeline
    pipe = mlflow.transformers.load_model(f"models:/{NAME}@champion")
    out = pipe("12 + 7 = ?", max_new_tokens=4)
    assert isinstance(out[0]["generated_text"], str) and out[0]["generated_text"].startswith("12 + 7 = ?")
    # pyfunc: one string in, one string out (the chat template applied around it)
    pyfunc = mlflow.pyfunc.load_model(f"models:/{NAME}/{reg['version']}")
    answers = pyfunc.predict(["12 + 7 = ?", "3 - 1 = ?"])
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    # per-request params (what `mlflow models serve` takes), by default the run's sampling
    params = {p.name: p.default for p in pyfunc.metadata.get_params_schema().params}
    assert params["max_new_tokens"] == cfg.data.max_response_length
    assert params["temperature"] == cfg.rollout.temperature and params["do_sample"]
    assert isinstance(
        pyfunc.predict(["12 + 7 = ?"], params={"max_new_tokens": 2, "do_sample": False})[0], str
    )

    # MLflow's copy holds the export's weights (save_pretrained of the same merged model) and its card
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}/{reg['version']}"))
    weights = (local / "model" / "model.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == m.file("model/model.safetensors").sha256
    assert f"registered model `{NAME}`" in (local / "model_card.md").read_text()

    # the card in the export (model/README.md): HF's front matter, then what the run was
    card = ModelCard(store.read_bytes(m, "model/README.md").decode())
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert "verl-flow" in card.data.tags and cfg.algorithm.adv_estimator in card.data.tags
    assert card.data.base_model is None  # built from scratch: no base model
    text = card.text
    for fact in (
        ctx.run_id,
        ctx.config_hash,
        version.tags["verl_flow.data_manifest_sha256"],  # the data's preprocess manifest
        uri,  # the export's own manifest in the lineage
        f"registered model `{NAME}`, version {reg['version']}",
        ctx.mlflow_run_id or "",
        "transformers>=5",
        f"at most {cfg.data.max_response_length} new tokens",  # generation_config.json's sampling
    ):
        assert fact in text, fact


def test_card_of_an_unregistered_export_with_validation(tmp_path: Path) -> None:
    ctx, cfg = _run(tmp_path, "card", 0)
    _checkpoint(ctx, cfg, 2)
    store = ctx.store()
    # the RL loop's validation of iteration 2: 6 of 8 held-out prompts right (TINY's arithmetic_val_size)
    stage = store.open_stage(ctx.run_id, "iter-0002/val", params={"iteration": 2})
    stage.commit(summary={"accuracy": 0.75})
    off = cfg.model_copy(update={"export": cfg.export.model_copy(update={"register_model": False})})
    m = store.read_manifest(export_model.fn(ctx, off, template_pack_uri(store, ctx.run_id), 2))
    text = ModelCard(store.read_bytes(m, "model/README.md").decode()).text
    assert "Not registered" in text
    # Wilson 95%: p̂ = 0.75, N = 8, z = 1.96: centre (0.75 + 0.240) / 1.480 = 0.669,
    # half 1.96 / 1.480 · sqrt(0.1875/8 + 3.8416/256) = 1.324 · 0.1960 = 0.260 → [0.409, 0.929]
    assert "| validation | `iter-0002/val` | 8 | 0.750 | [0.409, 0.929] |" in text
    assert "synthetic problems generated by the run" in text  # the data's licence, arithmetic
