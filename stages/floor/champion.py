"""The registry's champion as the gate sees it: its export in the store, its own eval when that eval
can stand beside this run's, and both evals' greedy answers paired prompt by prompt.

An eval is identified by its stage key (:func:`~verl_core.store.manifest.stage_input_key`): its name,
:func:`eval_params` (the eval, reward and generation settings) and its inputs' manifest hashes. The
champion's stored eval (``eval/{label}`` of the run that exported it) is reused when

- its ``policy`` input is the champion's export, as committed now;
- its ``prompts`` (the template_pack stage of the champion's run) hold the same held-out prompt file
  (sha256 of ``prompt_tokens/val.parquet``) as this run's;
- its key equals the key this run's eval settings give for it: the same settings.

Otherwise the champion's export is evaluated again in this run, on this run's prompts, as
``eval/champion-v{version}``; answers are never compared across different prompts
(:func:`paired_answers` checks it prompt by prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from stages.floor.artifacts import EvalSource
from stages.floor.locations import eval_label, eval_stage, export_stage
from stages.floor.registry import EXPORT_URI_TAG, RUN_ID_TAG, ModelVersionRef
from verl_core.config import VerlFlowConfig
from verl_core.errors import ArtifactError, ArtifactNotFoundError
from verl_core.store import ArtifactStore
from verl_core.store.manifest import stage_input_key

HELDOUT_PROMPTS = "prompt_tokens/val.parquet"  # the template_pack file eval answers
CHAMPION_LABEL = "champion-v"  # eval/champion-v{version}: the champion evaluated in a challenger's run
SOURCE_STAGE_TAG = "verl_flow.source_stage"  # export lineage tag: the checkpoint stage exported


def eval_params(cfg: VerlFlowConfig, source: EvalSource) -> dict[str, Any]:
    """What besides its inputs decides an eval stage's output (its ``params``)."""
    return {
        "eval": cfg.eval.model_dump(mode="json"),
        "reward": cfg.reward.model_dump(mode="json"),
        "max_response_length": cfg.data.max_response_length,
        "stop": cfg.rollout.stop,
        "model_dir": source.model_dir,
        **({"engine": cfg.rollout.name} if cfg.rollout.name != "hf" else {}),  # hf: the keys of before
        **({"endpoint": source.endpoint, "served_model": source.served_model} if source.endpoint else {}),
    }


def is_champion_label(label: str) -> bool:
    """Whether ``eval/{label}`` is the registry's champion evaluated in another run (the gate's)."""
    return label.startswith(CHAMPION_LABEL)


def eval_inputs(template_pack_uri: str, source: EvalSource) -> dict[str, str]:
    """An eval stage's inputs: the prompts and, for a committed policy, the policy."""
    return {"prompts": template_pack_uri, **({"policy": source.manifest_uri} if source.manifest_uri else {})}


@dataclass(frozen=True)
class Champion:
    """The champion version, its export's manifest URI, the source to evaluate it as in this run, and
    its own stored eval when reusable (None: evaluate ``source``)."""

    ref: ModelVersionRef
    export_uri: str
    source: EvalSource
    stored_eval: str | None


def champion_export(store: ArtifactStore, ref: ModelVersionRef) -> str:
    """The manifest URI of the export the version ``ref`` was registered from (its
    ``verl_flow.export_uri`` tag, else its run and source stage); an error naming the version and the
    missing export when it is gone from the store."""
    uri = ref.tags.get(EXPORT_URI_TAG)
    if uri is None:
        run_id, source_stage = ref.tags.get(RUN_ID_TAG), ref.tags.get(SOURCE_STAGE_TAG)
        if run_id is None or source_stage is None:
            raise ArtifactNotFoundError(
                f"champion {ref.uri}: no {EXPORT_URI_TAG} (nor {RUN_ID_TAG} + {SOURCE_STAGE_TAG}) tag; "
                "it was not registered by a verl-flow export"
            )
        uri = store.manifest_uri(run_id, export_stage(source_stage))
    try:
        manifest = store.read_manifest(uri)
        present = store.files_present(manifest)
    except ArtifactError as e:  # not found, corrupt, another store
        raise ArtifactNotFoundError(f"champion {ref.uri}: its export {uri} cannot be read ({e})") from None
    if not present:
        raise ArtifactNotFoundError(f"champion {ref.uri}: files of its export {uri} are gone from the store")
    return uri


def find_champion(
    store: ArtifactStore, cfg: VerlFlowConfig, ref: ModelVersionRef, template_pack_uri: str
) -> Champion:
    """The champion ``ref`` with its export and, when it can be reused (module docstring), its eval."""
    export_uri = champion_export(store, ref)
    source = EvalSource(f"{CHAMPION_LABEL}{ref.version}", manifest_uri=export_uri)
    return Champion(ref, export_uri, source, reusable_eval(store, cfg, template_pack_uri, export_uri))


def reusable_eval(
    store: ArtifactStore, cfg: VerlFlowConfig, template_pack_uri: str, export_uri: str
) -> str | None:
    """The committed eval of ``export_uri`` in its own run when it used this run's held-out prompts
    and eval settings (``cfg``); None otherwise."""
    export = store.read_manifest(export_uri)
    stage = eval_stage(eval_label(export.stage))
    found = store.committed(export.run_id, stage)
    if found is None or set(found.inputs) != {"prompts", "policy"}:
        return None
    policy, prompts = found.inputs["policy"], found.inputs["prompts"]
    if policy["uri"] != export_uri or policy["sha256"] != store.manifest_sha256(export_uri):
        return None
    try:
        theirs = store.read_manifest(prompts["uri"]).file(HELDOUT_PROMPTS).sha256
    except ArtifactError:
        return None
    if theirs != store.read_manifest(template_pack_uri).file(HELDOUT_PROMPTS).sha256:
        return None
    params = eval_params(cfg, EvalSource(eval_label(export.stage), manifest_uri=export_uri))
    hashes = {k: v["sha256"] for k, v in found.inputs.items()}
    if stage_input_key(stage, params, hashes) != found.input_key:
        return None
    return store.manifest_uri(export.run_id, stage)


def greedy_answers(store: ArtifactStore, eval_uri: str) -> pa.Table:
    """One row per prompt of the committed eval at ``eval_uri``: ``prompt_index``, ``data_source``,
    ``prompt_text`` and ``correct`` of its greedy response, sorted by prompt index."""
    m = store.read_manifest(eval_uri)
    r = store.read_table(m, "greedy/rollouts.parquet", columns=["prompt_index", "data_source", "prompt_text"])
    w = store.read_table(m, "greedy/rewards.parquet", columns=["correct"])
    index = r.column("prompt_index").to_pylist()
    if len(set(index)) != len(index):
        where = store.file_uri(m, "greedy/rollouts.parquet")
        raise ArtifactError(f"{where}: more than one greedy response for a prompt_index")
    table = pa.table(
        {
            "prompt_index": r.column("prompt_index"),
            "data_source": r.column("data_source"),
            "prompt_text": r.column("prompt_text"),
            "correct": w.column("correct"),
        }
    )
    return table.sort_by("prompt_index")


def paired_answers(store: ArtifactStore, challenger_eval: str, champion_eval: str | None) -> pa.Table:
    """The ``gate_pairs`` table: the challenger's greedy answers beside the champion's, prompt by
    prompt; an error naming both evals when they answered different prompts."""
    chal = greedy_answers(store, challenger_eval)
    champion: list[bool | None] = [None] * chal.num_rows
    if champion_eval is not None:
        champ = greedy_answers(store, champion_eval)
        ours = list(
            zip(chal.column("prompt_index").to_pylist(), chal.column("prompt_text").to_pylist(), strict=True)
        )
        theirs = list(
            zip(
                champ.column("prompt_index").to_pylist(), champ.column("prompt_text").to_pylist(), strict=True
            )
        )
        if ours != theirs:
            raise ArtifactError(
                f"gate: the champion's eval {champion_eval} answered other prompts than the challenger's "
                f"{challenger_eval} ({len(theirs)} vs {len(ours)} prompts, prompt_index/prompt_text differ)"
            )
        champion = champ.column("correct").to_pylist()
    return pa.table(
        {
            "prompt_index": chal.column("prompt_index"),
            "data_source": chal.column("data_source"),
            "prompt_text": chal.column("prompt_text"),
            "champion_correct": pa.array(champion, pa.bool_()),
            "challenger_correct": chal.column("correct"),
        }
    )


def registered_version(store: ArtifactStore, eval_uri: str) -> str | None:
    """``models:/NAME/VERSION`` of the export the eval at ``eval_uri`` evaluated, as its export stage
    registered it; None when its policy is not a registered export."""
    policy = store.read_manifest(eval_uri).inputs.get("policy")
    if policy is None:
        return None
    reg = store.read_manifest(policy["uri"]).summary.get("registered_model")
    return f"models:/{reg['name']}/{reg['version']}" if reg else None
