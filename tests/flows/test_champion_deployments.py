"""``retrain.start_from=champion`` with an S3 store (moto) in ``execution.mode=deployments``: the
pipeline flow runs for real and its SFT / RL-loop / export dispatches are run in this process as the
gpu pool's flow runs would run them: the parameters the pipeline builds (:func:`flows.dispatch.dispatch`)
through JSON, parsed into the flows' arguments, on "another machine" (its own empty champion cache,
nothing fetched yet in its process).

The champion is a tiny pretrained model (one layer, hidden size 32: not the quickstart's scratch
geometry) registered in MLflow from an export in the store. The run's config and run.json name it by
its store URI; the pipeline (template_pack's tokenizer) and the gpu pool's flows each fetch their own
copy once; the run trains from it (its export has the champion's geometry and vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import flows.dispatch as dispatch
from flows.gpu import export_flow, sft_flow
from flows.pipeline import rlhf_pipeline
from flows.rl import rl_loop
from stages.floor import initial_model, registry
from verl_core.config import ModelConfig, VerlFlowConfig, load_config
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore

pytestmark = pytest.mark.s3
NAME = "champion-s3"
GPU_FLOWS = {
    "execution.sft_deployment": sft_flow,
    "execution.rl_deployment": rl_loop,
    "execution.export_deployment": export_flow,
}
TINY = [
    "data.arithmetic_train_size=16",
    "data.arithmetic_val_size=4",
    "data.train_batch_size=2",
    "data.max_response_length=8",
    "data.truncation=right",  # SFT targets (no SFT here) may be longer
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",
    "critic.ppo_mini_batch_size=2",
    "trainer.total_iterations=1",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "eval.enable=false",  # the pipeline evaluates in its own process, from the export: not the point here
]


def _champion(store: ArtifactStore, tmp: Path) -> str:
    """A tiny pretrained model (trained tokenizer, random weights) committed as run night1's export."""
    from stages.floor.policy import build_policy
    from verl_core.data.tokenizer import train_tokenizer

    texts = [f"What is {a} + {b}? Answer: #### {a + b}" for a in range(20) for b in range(20)]
    tokenizer = train_tokenizer(texts, 300)
    small = ModelConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    lm = build_policy(small, tokenizer, seed=7)
    model_dir = tmp / "champion"
    lm.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    stage = store.open_stage("night1", "export/iter-0001", params={})
    for f in sorted(model_dir.iterdir()):
        stage.write_bytes(f"model/{f.name}", f.read_bytes())
    return stage.commit(summary={})


def test_a_champion_in_s3_starts_a_deployments_run(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    store = ArtifactStore(f"{s3_bucket}/team")
    export_uri = _champion(store, tmp_path)
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=tracking)
    client.create_registered_model(NAME)
    client.create_model_version(NAME, source="/fake", tags={"verl_flow.export_uri": export_uri})
    registry.promote(tracking, NAME, "1", decision={"verdict": "pass"}, by="gate")

    pipeline_cache, gpu_cache = tmp_path / "cpu-worker", tmp_path / "gpu-worker"
    monkeypatch.setattr(initial_model, "CHAMPION_CACHE", pipeline_cache)
    monkeypatch.setattr(initial_model, "_FETCHED", {})
    monkeypatch.setattr(initial_model, "_ENTRY_STORE", [])
    received: list[tuple[str, Any]] = []

    def on_the_gpu_pool(deployment: str, parameters: dict[str, Any], *, field: str, **_: Any) -> float:
        """A flow run of ``deployment`` on a gpu worker: JSON parameters, another cache, a new process."""
        params = json.loads(json.dumps(parameters))
        ctx = RunContext.model_validate(params.pop("ctx"))
        config = VerlFlowConfig.model_validate(params.pop("config"))
        received.append((field, config.model.path))
        here = initial_model.CHAMPION_CACHE, dict(initial_model._FETCHED), list(initial_model._ENTRY_STORE)
        initial_model.CHAMPION_CACHE = gpu_cache
        initial_model._FETCHED.clear()
        initial_model._ENTRY_STORE.clear()
        try:
            GPU_FLOWS[field].fn(ctx=ctx, config=config, **params)
        finally:
            initial_model.CHAMPION_CACHE = here[0]
            initial_model._FETCHED.clear()
            initial_model._FETCHED.update(here[1])
            initial_model._ENTRY_STORE[:] = here[2]
        return 0.0

    monkeypatch.setattr(dispatch, "run_stage_deployment", on_the_gpu_pool)
    deployed = [
        f"store.url={store.url}",
        f"tracking.uri={tracking}",
        "execution.mode=deployments",
        "execution.shared_filesystem=true",  # for the sqlite MLflow file; the store itself is S3
        "retrain.start_from=champion",
        f"export.registered_model_name={NAME}",
    ]
    cfg = load_config("configs/quickstart.yaml", [*TINY, *deployed])
    result = rlhf_pipeline(config=cfg, run_id="night2")

    # the config names the export by its URI: in run.json, and in what each gpu flow run received
    record = store.read_run_record("night2")
    assert record.config["model"]["path"] == export_uri and record.config["model"]["init"] == "pretrained"
    assert record.origin is not None and record.origin["start_from"] == "champion"
    assert (record.origin["model_uri"], record.origin["export_uri"]) == (f"models:/{NAME}/1", export_uri)
    assert record.origin["model_path"] == export_uri
    assert received == [("execution.rl_deployment", export_uri), ("execution.export_deployment", export_uri)]

    # each machine fetched one copy, named by the manifest's sha256, and nothing half-written is left
    sha = store.manifest_sha256(export_uri)
    for cache in (pipeline_cache, gpu_cache):
        assert sorted(p.name for p in cache.iterdir()) == [".locks", sha]
        assert (cache / sha / "model.safetensors").is_file()

    # the run trained from the champion: its export has the champion's geometry and vocabulary
    assert result.stages.export is not None
    exported = store.read_manifest(result.stages.export)
    config = json.loads(store.read_bytes(exported, "model/config.json"))
    champion = json.loads((gpu_cache / sha / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (32, 1)
    assert config["vocab_size"] == champion["vocab_size"]
