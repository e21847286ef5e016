"""Export stage (verl's model merger): a policy version of a run → one self-contained HF model dir.

Reads a policy checkpoint of the run (``ckpt/iter-XXXX`` of the RL loop, or the ``sft`` stage),
merges LoRA adapters into the base (``merge_and_unload``), and writes under the stage
``export/iter-XXXX`` (``export/sft`` for the SFT policy)::

    model/model.safetensors, model/config.json         weights and config (use_cache on)
    model/tokenizer.json, model/tokenizer_config.json  the run's tokenizer, chat template included
    model/chat_template.jinja                          (as transformers saves it)
    model/generation_config.json                       eos = end of turn, the run's sampling defaults

so that ``AutoModelForCausalLM.from_pretrained(dir)`` reproduces the training policy's logits and
``VLLMEngine(model=dir)`` / ``vllm serve dir`` can serve it. The directory is registered in the MLflow
model registry with lineage tags (run id, iteration, config hash, data manifest hash);
``verl-flow export --to`` copies it out (:func:`stages.floor.artifacts.copy_export`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from prefect import task
from torch import nn

from stages.floor.artifacts import MODEL_PREFIX, load_tokenizer, read_policy, resolve_source
from stages.floor.locations import PREPROCESS, export_stage
from stages.floor.logging import stage_logger
from verl_core.config import VerlFlowConfig
from verl_core.models.checkpoint import model_files
from verl_core.runtime.run import RunContext


@task(name="export", retries=0)
def export_model(
    ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, iteration: int | None = None
) -> str:
    """Merge and export policy version ``iteration`` of the run (None: the latest checkpoint) with the
    tokenizer of ``template_pack_uri``; returns the export stage's manifest URI."""
    log = stage_logger(__name__)
    store = ctx.store()
    # 1. Source checkpoint and tokenizer; skip when this very checkpoint was exported already
    source = resolve_source(store, ctx.run_id, iteration)
    params = {
        "iteration": source.iteration,
        "model": cfg.model.model_dump(mode="json"),
        "generation": _generation_params(cfg),
    }
    inputs = {"policy": source.manifest_uri, "tokenizer": template_pack_uri}
    stage = store.open_stage(ctx.run_id, export_stage(source.stage), params=params, inputs=inputs)
    if stage.done:
        log.info("export: %s already exported (%s)", source.stage, stage.manifest_uri)
        return stage.manifest_uri

    # 2. Load the policy as it was trained, merge LoRA into the base
    policy = read_policy(
        store, store.read_manifest(source.manifest_uri), "policy", cfg.model, for_training=False
    )
    merged = merge_policy(policy)
    tokenizer = load_tokenizer(store, template_pack_uri)

    # 3. Files: HF dir with tokenizer, chat template and generation config
    files = model_files(merged, tokenizer)
    files["generation_config.json"] = _generation_config(tokenizer, cfg).to_json_string().encode()
    for name, data in sorted(files.items()):
        stage.write_bytes(f"{MODEL_PREFIX}/{name}", data)

    # 4. Lineage, commit, register
    lineage = {
        "verl_flow.run_id": ctx.run_id,
        "verl_flow.iteration": str(source.iteration),
        "verl_flow.source_stage": source.stage,
        "verl_flow.config_hash": ctx.config_hash,
        "verl_flow.data_manifest_sha256": store.manifest_sha256(store.manifest_uri(ctx.run_id, PREPROCESS)),
        "verl_flow.policy_manifest_sha256": store.manifest_sha256(source.manifest_uri),
    }
    summary: dict[str, Any] = {"source": source.stage, "iteration": source.iteration, "lineage": lineage}
    if cfg.export.register_model and ctx.tracking_uri and ctx.mlflow_run_id:
        name = cfg.export.registered_model_name or f"{cfg.trainer.project_name}-{cfg.trainer.experiment_name}"
        summary["registered_model"] = register_model(ctx, files, export_stage(source.stage), name, lineage)
    uri = stage.commit(summary=summary)
    log.info("export: %s → %s", source.stage, uri)
    return uri


def merge_policy(policy: nn.Module) -> nn.Module:
    """The plain HF model: LoRA adapters merged into the base weights (PEFT ``merge_and_unload``),
    the model itself otherwise; in eval mode."""
    merge = getattr(policy, "merge_and_unload", None)
    model = merge() if callable(merge) else policy
    return model.eval()


def _generation_params(cfg: VerlFlowConfig) -> dict[str, Any]:
    r = cfg.rollout
    return {
        "max_new_tokens": cfg.data.max_response_length,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
    }


def _generation_config(tokenizer: Any, cfg: VerlFlowConfig) -> Any:
    """Sampling defaults of the run's rollouts; generation stops at eos or the end-of-turn token
    (as the rollout engine does)."""
    from transformers import GenerationConfig

    from verl_core.data.tokenizer import IM_END

    stop = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    im_end = tokenizer.get_vocab().get(IM_END)
    if im_end is not None and int(im_end) not in stop:
        stop.append(int(im_end))
    g = _generation_params(cfg)
    sampled = g["temperature"] > 0
    return GenerationConfig(
        eos_token_id=stop,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        max_new_tokens=g["max_new_tokens"],
        do_sample=sampled,
        temperature=g["temperature"] if sampled else None,
        top_p=g["top_p"] if sampled else None,
        top_k=g["top_k"] if sampled and g["top_k"] > 0 else None,
    )


def register_model(
    ctx: RunContext, files: dict[str, bytes], artifact_path: str, name: str, tags: dict[str, str]
) -> dict[str, str]:
    """Log the model dir as artifacts of the run's MLflow run and register it as a new version of
    ``name``; returns ``{"name", "version", "source"}``."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    assert ctx.tracking_uri is not None and ctx.mlflow_run_id is not None
    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        for file_name, data in files.items():
            (Path(tmp) / file_name).write_bytes(data)
        client.log_artifacts(ctx.mlflow_run_id, tmp, artifact_path)
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        try:
            client.create_registered_model(name, description="verl-flow exported policies")
        except MlflowException as e:  # another run's export created it meanwhile
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    source = f"runs:/{ctx.mlflow_run_id}/{artifact_path}"
    version = client.create_model_version(name, source=source, run_id=ctx.mlflow_run_id, tags=tags)
    client.set_tag(ctx.mlflow_run_id, "verl_flow.registered_model", f"{name}/{version.version}")
    return {"name": name, "version": str(version.version), "source": source}
