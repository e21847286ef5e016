"""Eval stage: a policy on the run's held-out prompts (for GSM8K, its test split), greedy and sampled.

The policy is an export of the run (``export/...``, what the pipeline evaluates last), an in-run
checkpoint (``ckpt/iter-XXXX`` or the SFT policy), or any exported HF directory. Writes under
``eval/{label}``::

    greedy/rollouts.parquet, greedy/rewards.parquet     one greedy response per prompt
    sampled/rollouts.parquet, sampled/rewards.parquet   eval.k samples per prompt (eval.k > 1)
    report.json                                         accuracy, pass@1, pass@k, per data source

and logs ``eval/accuracy``, ``eval/pass@k`` and ``eval/accuracy/{data_source}`` to MLflow.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from prefect import task
from torch import nn

from stages.floor.artifacts import (
    materialise_export,
    read_policy,
    resolve_source,
    rollouts_table,
    run_tokenizer,
)
from stages.floor.builders import build_scorers, score_batch
from stages.floor.locations import TEMPLATE_PACK, eval_label, eval_stage, parse_export_stage
from stages.floor.logging import stage_logger
from verl_core.config import VerlFlowConfig
from verl_core.evaluation import mean_by_source, pass_at_k, per_prompt_correct
from verl_core.models.loading import load_causal_lm, resolve_device
from verl_core.reward import batch_from_columns, rewards_table
from verl_core.rollout import SamplingParams, make_engine
from verl_core.run import RunContext
from verl_core.store import ArtifactStore

PROMPTS = "prompt_tokens/val.parquet"


@dataclass(frozen=True)
class EvalSource:
    """What is evaluated: a committed stage of the run (an export or a checkpoint), or a directory."""

    label: str  # the eval stage is eval/{label}
    manifest_uri: str | None = None
    model_dir: str | None = None


def in_run_source(store: ArtifactStore, run_id: str, iteration: int | None) -> EvalSource:
    """The run's checkpoint of ``iteration`` (None: the latest; 0: the SFT policy when there is no
    checkpoint at 0)."""
    s = resolve_source(store, run_id, iteration)
    return EvalSource(eval_label(s.stage), manifest_uri=s.manifest_uri)


def export_source(store: ArtifactStore, export_uri: str) -> EvalSource:
    """The committed export (or checkpoint) at ``export_uri``, named after its stage."""
    stage = store.read_manifest(export_uri).stage
    return EvalSource(eval_label(stage), manifest_uri=export_uri)


def dir_source(model_dir: str) -> EvalSource:
    path = str(Path(model_dir).expanduser().resolve())
    return EvalSource(f"dir-{hashlib.sha256(path.encode()).hexdigest()[:12]}", model_dir=path)


@task(name="eval")
def evaluate(ctx: RunContext, cfg: VerlFlowConfig, source: EvalSource) -> str:
    """Evaluate ``source`` on the run's held-out prompts; returns the eval stage's manifest URI."""
    log = stage_logger(__name__)
    store = ctx.store()
    e = cfg.eval
    # 1. Skip when this very policy was evaluated with the same settings
    tp_uri = store.manifest_uri(ctx.run_id, TEMPLATE_PACK)
    inputs = {"prompts": tp_uri, **({"policy": source.manifest_uri} if source.manifest_uri else {})}
    params = {
        "eval": e.model_dump(mode="json"),
        "reward": cfg.reward.model_dump(mode="json"),
        "max_response_length": cfg.data.max_response_length,
        "stop": cfg.rollout.stop,
        "model_dir": source.model_dir,
    }
    stage = store.open_stage(ctx.run_id, eval_stage(source.label), params=params, inputs=inputs)
    if stage.done:
        log.info("eval: %s already evaluated (%s)", source.label, stage.manifest_uri)
        return stage.manifest_uri

    # 2. Policy, tokenizer and the held-out prompts (tokenized with the policy's tokenizer)
    lm, tokenizer = _load(store, cfg, source)
    lm = lm.to(resolve_device(cfg.trainer.device)).eval()
    prompts = store.read_table(store.read_manifest(tp_uri), PROMPTS)
    if e.max_samples:
        prompts = prompts.slice(0, e.max_samples)
    if source.model_dir is None:  # the run's own tokenizer: the ids it was trained on
        ids = prompts.column("input_ids").to_pylist()
    else:
        texts = prompts.column("prompt_text").to_pylist()
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    engine = make_engine("hf", lm, tokenizer, max_batch_size=cfg.rollout.max_batch_size)

    # 3. Greedy pass (accuracy) and sampled pass (pass@k), scored by the run's reward scorers
    runs = {"greedy": SamplingParams(n=1, temperature=0.0, seed=e.seed)}
    if e.k > 1:
        runs["sampled"] = SamplingParams(n=e.k, temperature=e.temperature, top_p=e.top_p, seed=e.seed)
    per_prompt: dict[str, dict[int, tuple[int, int]]] = {}
    scorers = build_scorers(cfg.reward)
    for name, sp in runs.items():
        sp = SamplingParams(
            n=sp.n, temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
            max_new_tokens=cfg.data.max_response_length, stop=tuple(cfg.rollout.stop),
        )  # fmt: skip
        rollouts = rollouts_table(engine.generate(ids, sp), prompts, iteration=-1, policy_version=-1)
        batch = batch_from_columns(rollouts)
        result = score_batch(cfg.reward, batch, cfg.data.max_response_length, scorers)
        per_prompt[name] = per_prompt_correct(batch.group_id, result.correct)  # validation's rule too
        stage.write_table(f"{name}/rollouts.parquet", rollouts, "rollouts")
        stage.write_table(f"{name}/rewards.parquet", rewards_table(batch, result), "rewards")

    # 4. Report, metrics, commit
    report = _report(prompts.column("data_source").to_pylist(), per_prompt, e.k)
    stage.write_json("report.json", report)
    uri = stage.commit(summary={"source": source.label, **report})
    ctx.tracker().log_metrics(_metrics(report), step=0)
    log.info(
        "eval %s: greedy accuracy %.3f over %d prompts", source.label, report["accuracy"], report["prompts"]
    )
    return uri


def _load(store: ArtifactStore, cfg: VerlFlowConfig, source: EvalSource) -> tuple[nn.Module, Any]:
    from verl_core.data.tokenizer import load_tokenizer_from_files

    if source.model_dir is not None:
        return load_causal_lm(source.model_dir), load_tokenizer_from_files(source.model_dir)
    assert source.manifest_uri is not None
    manifest = store.read_manifest(source.manifest_uri)
    if parse_export_stage(manifest.stage) is not None:
        with tempfile.TemporaryDirectory() as tmp:
            d = materialise_export(store, manifest, tmp)
            return load_causal_lm(str(d)), load_tokenizer_from_files(d)
    policy = read_policy(store, manifest, "policy", cfg.model)
    return policy, run_tokenizer(store, manifest.run_id)


def _report(sources: list[str], per_prompt: dict[str, dict[int, tuple[int, int]]], k: int) -> dict[str, Any]:
    """Accuracy (greedy), pass@1 and pass@k (sampled), overall and per data source."""
    greedy = [c / n for _, (n, c) in sorted(per_prompt["greedy"].items())]
    report: dict[str, Any] = {
        "prompts": len(greedy),
        "accuracy": sum(greedy) / max(1, len(greedy)),
        "k": k,
        "by_source": {s: a._asdict() for s, a in mean_by_source(sources, greedy).items()},
    }
    if "sampled" in per_prompt:
        counts = [nc for _, nc in sorted(per_prompt["sampled"].items())]
        p1 = [pass_at_k(n, c, 1) for n, c in counts]
        pk = [pass_at_k(n, c, k) for n, c in counts]
        report["pass@1"] = sum(p1) / max(1, len(p1))
        report[f"pass@{k}"] = sum(pk) / max(1, len(pk))
        for s, a in mean_by_source(sources, pk).items():
            report["by_source"][s][f"pass@{k}"] = a.accuracy
    return report


def _metrics(report: dict[str, Any]) -> dict[str, float]:
    out = {"eval/accuracy": float(report["accuracy"])}
    for key in ("pass@1", f"pass@{report['k']}"):
        if key in report:
            out[f"eval/{key.replace('@', '_at_')}"] = float(report[key])  # MLflow names: no '@'
    for s, a in report["by_source"].items():
        out[f"eval/accuracy/{s}"] = float(a["accuracy"])
    return out


def sample_rows(store: ArtifactStore, eval_uri: str, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` greedy samples of an eval: prompt, response, answer, ground truth, score
    (for the Prefect table artifact and the CLI)."""
    m = store.read_manifest(eval_uri)
    r = store.read_table(m, "greedy/rollouts.parquet").slice(0, limit)
    w = store.read_table(m, "greedy/rewards.parquet").slice(0, limit)
    cols = {
        "data_source": r.column("data_source"),
        "prompt": r.column("prompt_text"),
        "response": r.column("response_text"),
        "extracted": w.column("extracted_answer"),
        "ground_truth": r.column("ground_truth"),
        "correct": w.column("correct"),
        "score": w.column("score"),
    }
    return pa.table(cols).to_pylist()
