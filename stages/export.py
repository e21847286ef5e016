"""Export stage (verl's model merger): a policy version of a run → one self-contained HF model dir.

Reads a policy checkpoint of the run (``ckpt/iter-XXXX`` of the RL loop, or the ``sft`` stage),
merges LoRA adapters into the base (``merge_and_unload``), and writes under the stage
``export/iter-XXXX`` (``export/sft`` for the SFT policy)::

    model/model.safetensors, model/config.json         weights and config (use_cache on)
    model/tokenizer.json, model/tokenizer_config.json  the run's tokenizer, chat template included
    model/chat_template.jinja                          (as transformers saves it)
    model/generation_config.json                       eos = end of turn, the run's sampling defaults
    model/README.md                                    the model card (stages.floor.model_card)

so that ``AutoModelForCausalLM.from_pretrained(dir)`` reproduces the training policy's logits and
``VLLMEngine(model=dir)`` / ``vllm serve dir`` can serve it; ``verl-flow export --to`` copies it out
(:func:`stages.floor.artifacts.copy_export`).

With tracking on and ``export.register_model``, the merged model is also logged to the run's MLflow
run with MLflow's ``transformers`` flavour (a logged model, task ``text-generation``, the card as its
``model_card.md``, the chat template as its pyfunc prompt template) and registered from there as a
new version of the registered model, with lineage tags (run id, iteration, config hash, data and
policy manifest hashes, ``verl_flow.export_uri`` = this stage's manifest URI). So MLflow's own
loaders work on every version: ``mlflow.transformers.load_model("models:/NAME@champion")`` (a
pipeline), ``mlflow.pyfunc.load_model(...).predict(["question"])`` (text in, the answer out), and
``mlflow models serve -m models:/NAME/VERSION --env-manager local``. The MLflow copy is written by
``save_pretrained`` of the same merged model (the same weights file); MLflow's path for a local
checkpoint directory fails with transformers 5 (its flavour reads ``check_task``'s pipeline class as
a class, transformers 5 gives its name), so the model goes in as ``{"model", "tokenizer"}``, with the
pip requirements given (:func:`_pip_requirements`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import task
from torch import nn

from stages.floor.artifacts import MODEL_PREFIX, load_tokenizer, read_policy, resolve_source
from stages.floor.locations import PREPROCESS, export_stage
from stages.floor.logging import stage_logger
from stages.floor.model_card import CARD_FILE, card_facts, render_card
from stages.floor.registry import EXPORT_URI_TAG, registered_name
from verl_core.config import VerlFlowConfig
from verl_core.models.checkpoint import model_files
from verl_core.runtime.run import RunContext


@task(name="export", retries=0)
def export_model(
    ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, iteration: int | None = None
) -> str:
    """Merge and export policy version ``iteration`` of the run (None: the latest checkpoint) with the
    tokenizer of ``template_pack_uri``; returns the export stage's manifest URI.

    Takes the whole config, not its sections: the model card
    (:func:`~stages.floor.model_card.render_card`) states how the policy was trained, from the actor,
    algorithm, data, gate, model, rollout, sft and trainer sections, and the registered model's name
    (:func:`~stages.floor.registry.registered_name`) reads export and trainer: nine sections."""
    log = stage_logger(__name__)
    store = ctx.store()
    # 1. Source checkpoint and tokenizer; skip when this very checkpoint was exported already
    source = resolve_source(store, ctx.run_id, iteration)
    sampling = _generation_params(cfg)
    params = {
        "iteration": source.iteration,
        "model": cfg.model.model_dump(mode="json"),
        "generation": sampling,
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
    generation = _generation_config(tokenizer, cfg)
    files["generation_config.json"] = generation.to_json_string().encode()

    # 4. Lineage and card facts; register (MLflow's transformers flavour), then the card names the version
    lineage = {
        "verl_flow.run_id": ctx.run_id,
        "verl_flow.iteration": str(source.iteration),
        "verl_flow.source_stage": source.stage,
        "verl_flow.config_hash": ctx.config_hash,
        "verl_flow.data_manifest_sha256": store.manifest_sha256(store.manifest_uri(ctx.run_id, PREPROCESS)),
        "verl_flow.policy_manifest_sha256": store.manifest_sha256(source.manifest_uri),
        EXPORT_URI_TAG: stage.manifest_uri,
    }
    artifacts = {"tokenizer": template_pack_uri, "policy": source.manifest_uri, "export": stage.manifest_uri}
    facts = card_facts(
        store, ctx.run_id, ctx.config_hash, source.stage, source.iteration, stage.stage, artifacts,
        cfg.gate.confidence,
    )  # fmt: skip
    summary: dict[str, Any] = {"source": source.stage, "iteration": source.iteration, "lineage": lineage}
    if cfg.export.register_model and ctx.tracking_uri and ctx.mlflow_run_id:
        # MLflow's copy is save_pretrained of the same model: the same config.json as model_files'
        merged.generation_config = generation
        merged.config.use_cache = True  # type: ignore[union-attr]

        def card(mlflow: dict[str, str]) -> Any:
            return render_card(cfg, replace(facts, mlflow=mlflow), sampling)

        registered = register_model(ctx, merged, tokenizer, registered_name(cfg), lineage, card, sampling)
        summary["registered_model"] = registered
        facts = replace(facts, mlflow=registered)
    files[CARD_FILE] = str(render_card(cfg, facts, sampling)).encode()

    # 5. Write, commit
    for name, data in sorted(files.items()):
        stage.write_bytes(f"{MODEL_PREFIX}/{name}", data)
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
    ctx: RunContext,
    model: nn.Module,
    tokenizer: Any,
    name: str,
    tags: dict[str, str],
    card: Callable[[dict[str, str]], Any],
    sampling: dict[str, Any],
) -> dict[str, str]:
    """Log ``model`` and ``tokenizer`` to the run's MLflow run with MLflow's ``transformers`` flavour
    (a logged model) and register it as a new version of ``name`` with ``tags``; ``card(facts)``
    gives the model card for the facts known before the version exists; ``sampling``: the defaults
    of the per-request params (:func:`_signature`). Returns the facts:
    ``name``, ``version``, ``source``, ``logged_model``, ``run_id``, ``tracking_uri``."""
    import mlflow.transformers
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model
    from mlflow.tracking import MlflowClient

    assert ctx.tracking_uri is not None and ctx.mlflow_run_id is not None
    run_id = ctx.mlflow_run_id
    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    iteration = int(tags["verl_flow.iteration"])
    logged = client.create_logged_model(
        experiment_id, name=name, source_run_id=run_id, tags=tags, model_type="text-generation"
    )
    facts = {
        "tracking_uri": ctx.tracking_uri,
        "run_id": run_id,
        "logged_model": logged.model_id,
        "name": name,
    }
    try:  # a logged model whose artifacts did not all arrive is marked FAILED, not left PENDING
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model"
            meta = Model(artifact_path=logged.artifact_location, run_id=run_id, model_id=logged.model_id)
            meta.model_uuid = logged.model_id
            mlflow.transformers.save_model(
                {"model": model, "tokenizer": tokenizer},
                str(path),
                task="text-generation",
                model_card=card(facts),
                mlflow_model=meta,
                prompt_template=_prompt_template(tokenizer),
                signature=_signature(sampling),
                pip_requirements=_pip_requirements(),
            )
            client.log_model_artifacts(logged.model_id, str(path))
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=iteration)])
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        try:
            client.create_registered_model(name, description="verl-flow exported policies")
        except MlflowException as e:  # another run's export created it meanwhile
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    # the logged model's storage location, not its models:/ URI: MLflow's SQL registry resolves that
    # URI through the process-wide tracking URI, not this client's
    source = logged.artifact_location
    version = client.create_model_version(name, source, run_id=run_id, tags=tags, model_id=logged.model_id)
    client.set_tag(run_id, "verl_flow.registered_model", f"{name}/{version.version}")
    return {**facts, "version": str(version.version), "source": source}


def _signature(sampling: dict[str, Any]) -> Any:
    """One string in (the user's message), one string out (the answer); per-request params
    (``{"inputs": [...], "params": {"max_new_tokens": 16}}`` to ``mlflow models serve``) whose
    defaults are the run's sampling, as in generation_config.json."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    sampled = sampling["temperature"] > 0
    params = [
        ParamSpec("max_new_tokens", "long", sampling["max_new_tokens"]),
        ParamSpec("do_sample", "boolean", sampled),
        ParamSpec("temperature", "double", float(sampling["temperature"]) if sampled else 1.0),
        ParamSpec("top_p", "double", float(sampling["top_p"])),
    ]
    text = Schema([ColSpec("string")])
    return ModelSignature(inputs=text, outputs=text, params=ParamSchema(params))


def _pip_requirements() -> list[str]:
    """The packages that load the logged model, pinned to the versions that wrote it (a local
    version label such as ``+cpu`` dropped: PyPI has none). Given, because MLflow would otherwise
    infer them by loading the model in a subprocess (and its default list requires torchvision)."""
    from importlib.metadata import version

    return [
        f"{p}=={version(p).split('+')[0]}" for p in ("transformers", "tokenizers", "torch", "safetensors")
    ]


def _prompt_template(tokenizer: Any) -> str:
    """The chat template around one user message as MLflow's ``{prompt}`` template (pyfunc and
    ``mlflow models serve`` put each input string into it): braces of the template escaped."""
    marker = "\x00prompt\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    return str(text).replace("{", "{{").replace("}", "}}").replace(marker, "{prompt}")
