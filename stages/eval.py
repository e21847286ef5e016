"""Eval stage: a policy on the run's held-out prompts (for GSM8K, its test split), greedy and sampled.

The policy (a :class:`~stages.floor.artifacts.EvalSource`) is an export of the run (``export/...``,
what the pipeline evaluates last), an in-run checkpoint (``ckpt/iter-XXXX`` or the SFT policy), any
exported HF directory, or a model behind an OpenAI-compatible server (``verl-flow serve``; its
completions through :class:`~verl_core.rollout.endpoint.EndpointEngine`, the prompts as the run's
token ids, always re-evaluated since the server's model can change behind its URL); the prompts and
the run's tokenizer come from the template_pack stage whose URI the stage is given. The same scoring
and report whatever the source. Writes under ``eval/{label}``::

    greedy/rollouts.parquet, greedy/rewards.parquet     one greedy response per prompt
    sampled/rollouts.parquet, sampled/rewards.parquet   eval.k samples per prompt (eval.k > 1)
    report.json                                         accuracy, pass@1, pass@k, per data source
                                                        (:class:`~stages.floor.reports.EvalReport`,
                                                        also the manifest summary)

and logs ``eval/accuracy``, ``eval/pass@k`` and ``eval/accuracy/{data_source}`` to MLflow (the gate's
evaluation of the registry's champion, ``eval/champion-v{version}``: under ``gate/champion/``).
"""

from __future__ import annotations

import tempfile
from typing import Any

from prefect import task
from torch import nn

from stages.floor.artifacts import (
    EvalSource,
    load_tokenizer,
    materialise_export,
    read_policy,
)
from stages.floor.champion import HELDOUT_PROMPTS, eval_inputs, eval_params, is_champion_label
from stages.floor.engines import engine_kwargs
from stages.floor.heldout import Scored, generate_passes, greedy_sampling, sampled_sampling, score_passes
from stages.floor.locations import eval_stage, parse_export_stage
from stages.floor.logging import stage_logger
from stages.floor.reports import EvalReport, SourceReport
from stages.floor.scorers import build_scorers
from verl_core.algorithms.evaluation import mean_by_source
from verl_core.config import VerlFlowConfig
from verl_core.models.loading import load_causal_lm, resolve_device
from verl_core.rollout import RolloutEngine, make_engine
from verl_core.rollout.endpoint import EndpointEngine, check_tokenizer
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore


@task(name="eval")
def evaluate(ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, source: EvalSource) -> str:
    """Evaluate ``source`` on the held-out prompts of ``template_pack_uri`` (the run's template_pack
    stage); returns the eval stage's manifest URI.

    Takes the whole config, not its sections: its engine is built as the RL loop's
    (:func:`~stages.floor.engines.engine_kwargs`, a registry of per-engine builders that each take the
    config: the rollout, model and actor sections), and its params
    (:func:`~stages.floor.champion.eval_params`) and body read eval, reward, sandbox, data, rollout,
    model and trainer besides: eight of the config's sections."""
    log = stage_logger(__name__)
    store = ctx.store()
    e = cfg.eval
    # 1. Skip when this very policy was evaluated with the same settings
    inputs, params = eval_inputs(template_pack_uri, source), eval_params(cfg, source)
    force = source.endpoint is not None  # the model behind a URL can change: never skip
    stage = store.open_stage(ctx.run_id, eval_stage(source.label), params=params, inputs=inputs, force=force)
    if stage.done:
        log.info("eval: %s already evaluated (%s)", source.label, stage.manifest_uri)
        return stage.manifest_uri

    # 2. Engine, tokenizer and the held-out prompts (tokenized with the policy's tokenizer)
    prompts = store.read_table(store.read_manifest(template_pack_uri), HELDOUT_PROMPTS)
    if e.max_samples:
        prompts = prompts.slice(0, e.max_samples)
    # the scorers first: a missing token or sandbox fails before any generation
    scorers = build_scorers(cfg.reward, cfg.sandbox)
    engine, tokenizer = _engine(store, cfg, source, template_pack_uri)
    max_len = cfg.data.max_response_length
    try:  # the engine is closed after generating (a vLLM engine's process, a server connection)
        if source.model_dir is None:  # the run's own tokenizer: the ids it was trained on
            ids = prompts.column("input_ids").to_pylist()
        else:
            texts = prompts.column("prompt_text").to_pylist()
            ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        if isinstance(engine, EndpointEngine) and prompts.num_rows:  # the server reads our ids as our text
            text = prompts.column("prompt_text")[0].as_py()
            check_tokenizer(engine, text, tokenizer(text, add_special_tokens=False)["input_ids"])

        # 3. Greedy pass (accuracy) and sampled pass (pass@k)
        passes = {"greedy/": greedy_sampling(e, max_len, cfg.rollout.stop)}
        sampled = sampled_sampling(e, max_len, cfg.rollout.stop)
        if sampled is not None:
            passes["sampled/"] = sampled
        generated = generate_passes(
            engine, tokenizer, ids, passes, cfg.rollout.multi_turn, max_len, cfg.sandbox
        )
    finally:
        engine.close()

    # 4. Score with the run's reward scorers (built once for both passes), write, report, commit
    scored = score_passes(
        stage, prompts, generated, scorers,
        reward=cfg.reward, sandbox=cfg.sandbox, max_response_length=max_len, iteration=-1, policy_version=-1,
    )  # fmt: skip
    report = _report(source.label, prompts.column("data_source").to_pylist(), scored, e.k)
    stage.write_json("report.json", report.summary())
    uri = stage.commit(summary=report.summary())
    # the registry's champion evaluated on this run's prompts (the gate) is not this run's policy
    prefix = "gate/champion" if is_champion_label(source.label) else "eval"
    ctx.tracker().log_metrics(_metrics(report, prefix), step=0)
    log.info("eval %s: greedy accuracy %.3f over %d prompts", source.label, report.accuracy, report.prompts)
    return uri


def _engine(
    store: ArtifactStore, cfg: VerlFlowConfig, source: EvalSource, template_pack_uri: str
) -> tuple[RolloutEngine, Any]:
    """The engine that answers the prompts and the tokenizer of its policy: the run's rollout engine
    (``rollout.name``, built like the RL loop's) on the loaded policy, or the server's completions with
    the run's tokenizer."""
    if source.endpoint is not None:
        tokenizer = load_tokenizer(store, template_pack_uri)
        return EndpointEngine(source.endpoint, tokenizer, source.served_model), tokenizer
    lm, tokenizer = _load(store, cfg, source, template_pack_uri)
    lm = lm.to(resolve_device(cfg.trainer.device)).eval()
    engine = make_engine(cfg.rollout.name, lm, tokenizer, **engine_kwargs(cfg))
    return engine, tokenizer


def _load(
    store: ArtifactStore, cfg: VerlFlowConfig, source: EvalSource, template_pack_uri: str
) -> tuple[nn.Module, Any]:
    """The policy and its tokenizer: an export's or a directory's own, else the run's."""
    from verl_core.data.tokenizer import load_tokenizer_from_files

    if source.model_dir is not None:
        return load_causal_lm(source.model_dir), load_tokenizer_from_files(source.model_dir)
    assert source.manifest_uri is not None
    manifest = store.read_manifest(source.manifest_uri)
    if parse_export_stage(manifest.stage) is not None:
        with tempfile.TemporaryDirectory() as tmp:
            d = materialise_export(store, manifest, tmp)
            return load_causal_lm(str(d)), load_tokenizer_from_files(d)
    policy = read_policy(store, manifest, "policy", cfg.model, for_training=False)
    return policy, load_tokenizer(store, template_pack_uri)


def _report(label: str, sources: list[str], scored: dict[str, Scored], k: int) -> EvalReport:
    """Accuracy (greedy), pass@1 and pass@k (sampled), overall and per data source."""
    greedy = [c / n for n, c in scored["greedy/"].per_prompt.values()]
    by_source = {
        s: SourceReport(prompts=a.prompts, accuracy=a.accuracy)
        for s, a in mean_by_source(sources, greedy).items()
    }
    pass_1 = pass_k = None
    if "sampled/" in scored:
        sampled = scored["sampled/"]
        pass_1, pass_k = sampled.pass_at(1), sampled.pass_at(k)
        for s, a in mean_by_source(sources, sampled.pass_at_k_each(k)).items():
            by_source[s] = by_source[s].model_copy(update={"pass_at_k": a.accuracy})
    return EvalReport(
        source=label,
        prompts=len(greedy),
        accuracy=sum(greedy) / max(1, len(greedy)),
        k=k,
        pass_at_1=pass_1,
        pass_at_k=pass_k,
        by_source=by_source,
    )


def _metrics(report: EvalReport, prefix: str) -> dict[str, float]:
    out = {f"{prefix}/accuracy": report.accuracy}
    if report.pass_at_1 is not None:  # MLflow names: no '@'
        out[f"{prefix}/pass_at_1"] = report.pass_at_1
    if report.pass_at_k is not None:
        out[f"{prefix}/pass_at_{report.k}"] = report.pass_at_k
    for s, a in report.by_source.items():
        out[f"{prefix}/accuracy/{s}"] = a.accuracy
    return out
