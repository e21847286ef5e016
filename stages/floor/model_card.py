"""The model card of an export: ``model/README.md`` in Hugging Face's model-card layout, a
``huggingface_hub.ModelCard`` (YAML front matter, then Markdown sections).

Front matter (:class:`huggingface_hub.ModelCardData`): ``library_name: transformers``,
``pipeline_tag: text-generation``, ``tags`` (verl-flow, the advantage estimator), ``base_model``
(``model.path`` when it is a hub id), ``license`` (the base model's, read from its own card when
that card is on this machine), ``datasets`` (the hub dataset the run read, when known). Sections:
base model, training data (files, row counts, preprocess manifest and its sha256, licence), the
main training settings and the config hash, held-out results with Wilson intervals, promotion,
MLflow run and registered version, the lineage of artifacts (manifest URIs), and how to use the
model (the transformers version it needs, the sampling ``generation_config.json`` carries).

What the card holds is what exists when the export is written. The pipeline evaluates *after*
exporting, so the card has the held-out validation of the exported iteration (when the RL loop
validated it) and an eval of this very export only when one was committed before the export ran.
The gate's decision comes later still: it is recorded on the registered model version (tags
``verl_flow.decision.*``, ``verl-flow models NAME``) and in the gate stage's decision record, and the
card says where. Committed artifacts never change, so the card is not re-rendered afterwards;
:func:`render_card` takes plain facts, so a later stage can render a card of its own.

Transformers version: an export is written by transformers 5, and needs it: 4.x cannot load its
tokenizer (``tokenizer_class: TokenizersBackend``), and 4.x reads ``config.json`` without its
``rope_parameters`` (it falls back to ``rope_theta`` 10000 silently: wrong positions for a base
trained with another theta). The card states the requirement (:data:`TRANSFORMERS_REQUIREMENT`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from stages.floor.initial_model import is_store_uri, model_dir
from stages.floor.locations import PREPROCESS, TEMPLATE_PACK, eval_label, eval_stage, iteration_stage
from verl_core.algorithms.paired import Interval, wilson_interval
from verl_core.config import VerlFlowConfig
from verl_core.errors import ConfigError
from verl_core.store import ArtifactStore

CARD_FILE = "README.md"  # beside config.json: the name the Hugging Face Hub shows
TRANSFORMERS_REQUIREMENT = "transformers>=5"
# the licence of data a run can read, by data.source or hub dataset id (where it is known)
DATA_LICENSES = {"gsm8k": "MIT", "openai/gsm8k": "MIT"}
DATA_HUB_IDS = {"gsm8k": "openai/gsm8k"}  # the hub dataset a built-in adapter reads


@dataclass(frozen=True)
class HeldOut:
    """A greedy held-out accuracy of the exported policy, with its Wilson interval."""

    label: str  # "validation" (the RL loop's, at the exported iteration) or "eval"
    stage: str  # the stage that measured it
    prompts: int
    accuracy: float
    ci: Interval


@dataclass(frozen=True)
class CardFacts:
    """What the card says beyond the config: the run, its lineage, the measured results, MLflow."""

    run_id: str
    config_hash: str
    source_stage: str  # the exported policy stage (ckpt/iter-XXXX or sft)
    iteration: int
    lineage: dict[str, str]  # role → manifest URI (data, tokenizer, policy, export)
    hashes: dict[str, str]  # role → manifest sha256
    rows: dict[str, int]  # preprocess row counts by split
    held_out: tuple[HeldOut, ...] = ()
    mlflow: dict[str, str] = field(default_factory=dict)  # tracking_uri, run_id, logged_model, name, version


def card_facts(
    store: ArtifactStore,
    run_id: str,
    config_hash: str,
    source_stage: str,
    iteration: int,
    export_stage: str,
    lineage: dict[str, str],
    confidence: float,
) -> CardFacts:
    """The facts of ``export_stage``, the export of ``source_stage`` (policy version ``iteration``),
    as the store has them now; ``lineage``: role → manifest URI (``policy`` at least)."""
    data_uri = store.manifest_uri(run_id, PREPROCESS)
    lineage = {"data": data_uri, **lineage}
    hashes = {role: store.manifest_sha256(lineage[role]) for role in ("data", "policy")}
    rows = dict(store.read_manifest(data_uri).summary.get("rows", {}))
    pack = store.committed(run_id, TEMPLATE_PACK)
    prompts = int(pack.summary.get("rows", {}).get("prompts_val", 0)) if pack else 0
    held_out = []
    val = store.committed(run_id, iteration_stage(iteration, "val")) if source_stage != "sft" else None
    if val is not None and prompts:
        held_out.append(_held_out("validation", val.stage, prompts, val.summary["accuracy"], confidence))
    ev = store.committed(run_id, eval_stage(eval_label(export_stage)))
    if ev is not None:
        s = ev.summary
        held_out.append(_held_out("eval", ev.stage, int(s["prompts"]), s["accuracy"], confidence))
    return CardFacts(run_id, config_hash, source_stage, iteration, lineage, hashes, rows, tuple(held_out))


def _held_out(label: str, stage: str, prompts: int, accuracy: float, confidence: float) -> HeldOut:
    # one greedy answer per prompt: accuracy = correct / prompts
    correct = round(accuracy * prompts)
    return HeldOut(label, stage, prompts, accuracy, wilson_interval(correct, prompts, confidence))


def base_license(path: str | None) -> str | None:
    """The ``license`` of the base model's own card (a local directory's README.md, or a hub
    model's README.md when it is in the local cache); None when no card is at hand."""
    if path is None:
        return None
    if is_store_uri(path):  # a champion's export in a team store: this process's copy (fetched at entry)
        try:
            path = model_dir(path)
        except ConfigError:
            return None
    local = Path(path).expanduser()
    readme: Path | None = local / CARD_FILE if local.is_dir() else None
    if readme is None:
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(path, CARD_FILE)
        except ValueError:  # not a hub id
            cached = None
        readme = Path(cached) if isinstance(cached, str) else None
    if readme is None or not readme.is_file():
        return None
    try:
        return ModelCard.load(readme).data.license
    except Exception:  # a card without valid front matter says nothing about its licence
        return None


def render_card(cfg: VerlFlowConfig, facts: CardFacts, generation: dict[str, Any]) -> ModelCard:
    """The card (see the module docstring); ``generation``: the sampling defaults written to
    ``generation_config.json``."""
    m = cfg.model
    hub_base = (
        m.path if m.init == "pretrained" and m.path and not Path(m.path).expanduser().exists() else None
    )
    dataset = _hub_dataset(cfg)
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        base_model=hub_base,
        license=base_license(m.path) if m.init == "pretrained" else None,
        datasets=[dataset] if dataset else None,
        tags=["verl-flow", "reinforcement-learning", cfg.algorithm.adv_estimator],
    )
    name = facts.mlflow.get("name") or f"{cfg.trainer.project_name}-{cfg.trainer.experiment_name}"
    body = "\n\n".join(
        [
            f"# {name}",
            f"A policy trained with verl-flow ({cfg.algorithm.adv_estimator}): `{facts.source_stage}` "
            f"(policy version {facts.iteration}) of run `{facts.run_id}`, LoRA adapters merged, "
            "saved as one Hugging Face model directory.",
            _base_section(cfg, data.license),
            _data_section(cfg, facts, dataset),
            _training_section(cfg, facts),
            _results_section(cfg, facts),
            _mlflow_section(facts),
            _lineage_section(facts),
            _usage_section(name, generation, facts.mlflow),
        ]
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n")


def _hub_dataset(cfg: VerlFlowConfig) -> str | None:
    d = cfg.data
    if d.source == "hf" and d.train_files:
        return d.train_files[0]
    return DATA_HUB_IDS.get(d.source)


def _base_section(cfg: VerlFlowConfig, license_: str | None) -> str:
    m = cfg.model
    if m.init == "scratch":
        source = (
            f"built from scratch: {m.architecture}, hidden size {m.hidden_size}, {m.num_hidden_layers} "
            f"layers, tokenizer of at most {m.vocab_size} tokens trained on the run's data"
        )
    else:
        source = (
            f"`{m.path}` ({'a local directory' if Path(str(m.path)).expanduser().exists() else 'hub id'})"
        )
    lora = f"LoRA rank {m.lora_rank}, merged into the weights" if m.lora_rank > 0 else "full fine-tuning"
    lic = license_ or "not recorded here: see the base model's own card"
    return f"## Base model\n\n- source: {source}\n- training: {lora}\n- licence of the base: {lic}"


def _data_section(cfg: VerlFlowConfig, facts: CardFacts, dataset: str | None) -> str:
    d = cfg.data
    files = ", ".join(f"`{f}`" for f in [*d.train_files, *d.val_files]) or "the adapter's default"
    lic = DATA_LICENSES.get(d.source) or (DATA_LICENSES.get(dataset) if dataset else None)
    if d.source == "arithmetic":
        lic = "synthetic problems generated by the run (no third-party data)"
    rows = ", ".join(f"{k} {v}" for k, v in sorted(facts.rows.items()))
    return (
        "## Training data\n\n"
        f"- adapter: `{d.source}`{f' (`{dataset}`)' if dataset else ''}; files as read: {files} "
        "(inside the dated snapshot directory the run read when `data.snapshot_prefix` was set; "
        "run.json holds the resolved paths)\n"
        f"- rows after cleaning: {rows}\n"
        f"- preprocess manifest: `{facts.lineage['data']}`, sha256 `{facts.hashes['data']}`\n"
        f"- data licence: {lic or 'not recorded: see the data source'}"
    )


def _training_section(cfg: VerlFlowConfig, facts: CardFacts) -> str:
    a, r, al, t = cfg.actor, cfg.rollout, cfg.algorithm, cfg.trainer
    kl = []
    if a.use_kl_loss:
        kl.append(f"KL loss {a.kl_loss_type}, coefficient {a.kl_loss_coef}")
    if al.use_kl_in_reward:
        kl.append(f"KL in reward {al.kl_penalty}, β {al.kl_ctrl.kl_coef} ({al.kl_ctrl.type})")
    sft = f"{cfg.sft.epochs} epochs at lr {cfg.sft.lr}" if cfg.sft.enable else "off"
    rows = [
        ("algorithm (advantage estimator)", al.adv_estimator),
        ("policy version exported / RL iterations configured", f"{facts.iteration} / {t.total_iterations}"),
        ("actor learning rate", f"{a.lr:g}"),
        ("prompts per iteration × samples per prompt", f"{cfg.data.train_batch_size} × {r.n}"),
        ("prompts per optimizer step, epochs per iteration", f"{a.ppo_mini_batch_size}, {a.ppo_epochs}"),
        ("KL regularisation", "; ".join(kl) or "none"),
        ("rollout sampling", f"temperature {r.temperature}, top_p {r.top_p}, top_k {r.top_k}"),
        ("max prompt / response tokens", f"{cfg.data.max_prompt_length} / {cfg.data.max_response_length}"),
        ("SFT warm-up", sft),
        ("config hash (sha256 of the resolved config)", f"`{facts.config_hash}`"),
    ]
    table = _table(("setting", "value"), rows)
    return f"## Training\n\n{table}\n\nThe full resolved config is the run's `run.json`."


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    lines = [header, tuple("---" for _ in header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def _results_section(cfg: VerlFlowConfig, facts: CardFacts) -> str:
    conf = f"{cfg.gate.confidence:.0%}"
    if facts.held_out:
        header = ("result", "stage", "prompts", "accuracy", f"{conf} Wilson interval")
        rows = [
            (
                h.label,
                f"`{h.stage}`",
                str(h.prompts),
                f"{h.accuracy:.3f}",
                f"[{h.ci.low:.3f}, {h.ci.high:.3f}]",
            )
            for h in facts.held_out
        ]
        table = _table(header, rows) + (
            "\n\nvalidation: the RL loop's pass at `rollout.val_temperature` (0: greedy); eval: greedy."
        )
    else:
        table = "No held-out result of this policy existed when the export was written."
    return (
        "## Evaluation and promotion\n\n"
        f"{table}\n\n"
        "The pipeline evaluates the export after writing it (stage `eval/` of the run). The gate's "
        "decision (champion/challenger comparison on the same held-out prompts) is recorded on the "
        "registered model version as tags `verl_flow.decision.*` (`verl-flow models NAME` lists them) "
        "and in the run's gate decision record."
    )


def _mlflow_section(facts: CardFacts) -> str:
    f = facts.mlflow
    if not f:
        return "## MLflow\n\nNot registered (tracking off or `export.register_model=false`)."
    version = (
        f"version {f['version']}" if f.get("version") else "the version registered from this logged model"
    )
    return (
        "## MLflow\n\n"
        f"- tracking URI: `{f['tracking_uri']}`, run `{f['run_id']}`\n"
        f"- logged model (transformers flavour): `models:/{f['logged_model']}`\n"
        f"- registered model `{f['name']}`, {version}"
    )


def _lineage_section(facts: CardFacts) -> str:
    rows = [
        (role, f"`{uri}`", f"`{facts.hashes[role]}`" if role in facts.hashes else "")
        for role, uri in facts.lineage.items()
    ]
    return "## Lineage\n\n" + _table(("artifact", "manifest URI", "manifest sha256"), rows)


def _usage_section(name: str, generation: dict[str, Any], mlflow: dict[str, str]) -> str:
    g = generation
    sampling = "greedy"
    if g["temperature"] > 0:
        top_k = f", top_k {g['top_k']}" if g["top_k"] > 0 else ""
        sampling = f"temperature {g['temperature']}, top_p {g['top_p']}{top_k}"
    sampling += f", at most {g['max_new_tokens']} new tokens"
    ref = f"models:/{name}/{mlflow['version']}" if mlflow.get("version") else f"models:/{name}@champion"
    return f"""## How to use

Requires `{TRANSFORMERS_REQUIREMENT}`: transformers 4.x cannot load this tokenizer
(`tokenizer_class: TokenizersBackend`) and reads `config.json` without its `rope_parameters`.

`generation_config.json` carries the run's rollout sampling: {sampling},
stopping at the end of the assistant turn. A bare `generate()` samples that way; `do_sample=False`
gives the greedy answers the held-out accuracy measures:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "."  # this directory
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
inputs = tok.apply_chat_template(
    [{{"role": "user", "content": "12 + 7 - 3 = ?"}}],
    add_generation_prompt=True, return_dict=True, return_tensors="pt",
)
out = model.generate(**inputs)  # the sampling of generation_config.json
print(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

From MLflow: `mlflow.transformers.load_model("{ref}")` (a text-generation pipeline),
`mlflow.pyfunc.load_model("{ref}").predict(["12 + 7 - 3 = ?"])` (each string is put into the chat
template as the user's turn; the answer comes back), or
`mlflow models serve -m "{ref}" --env-manager local`. With vLLM: `verl-flow serve {ref}`
or `vllm serve DIR`."""
