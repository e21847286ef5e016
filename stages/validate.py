"""Validation stage: greedy (``rollout.val_temperature``) generation on the held-out prompts with the
current policy, scored by the run's reward scorers. Writes ``iter-XXXX/val/{rollouts,rewards}.parquet``
and logs ``val/accuracy``, ``val/reward_mean``, ``val/response_length`` at step = iteration, and the
first ``tracking.log_samples`` samples (prompt, response, score) as a table.

With ``eval.k`` > 1 it also samples ``eval.k`` responses per held-out prompt (``eval.temperature``,
``eval.top_p``, ``eval.seed``: the eval stage's sampled pass, so the last validation and the eval of
the same policy agree) into ``iter-XXXX/val/sampled/{rollouts,rewards}.parquet`` and logs
``val/pass_at_1`` and ``val/pass_at_{k}`` (the unbiased estimator,
:func:`verl_core.algorithms.evaluation.pass_at_k`): greedy accuracy far below pass@k says sampling finds
answers that RL can turn into pass@1. The seed does not change with the iteration, so every validation draws
the same random numbers and the curve shows the policy's change, not sampling noise.

The passes are :mod:`stages.floor.heldout`'s (eval makes the same); the scorers are the RL session's,
built on the loop's first call and reused (:meth:`stages.floor.session.RLSession.scorers`).

It takes the sections it reads (``data``, ``rollout``, ``reward``, ``eval``, ``sandbox``) and
``tracking.log_samples``; the task is a shell that looks the run's RL session up once
(:func:`stages.floor.session.session_of`) and hands it to :func:`run_validation`."""

from __future__ import annotations

from typing import NamedTuple

import pyarrow as pa
from prefect import task

from stages.floor.commit import commit_once, main_value
from stages.floor.heldout import Generated, generate_passes, sampled_sampling, score_passes
from stages.floor.locations import iteration_stage
from stages.floor.rollouts import sampling_params
from stages.floor.samples import log_samples, sample_columns
from stages.floor.session import RLSession, session_of
from verl_core.config import (
    PLACEMENT_FIELDS,
    DataConfig,
    EvalConfig,
    RewardConfig,
    RolloutConfig,
    SandboxConfig,
)
from verl_core.runtime.run import RunContext
from verl_core.store import StageWriter

PROMPTS = "prompt_tokens/val.parquet"


class Sections(NamedTuple):
    """The config sections validation reads (``heldout``: the ``eval`` section, its sampled pass)."""

    data: DataConfig
    rollout: RolloutConfig
    reward: RewardConfig
    heldout: EvalConfig
    sandbox: SandboxConfig


@task(name="validate")
def validate(
    ctx: RunContext,
    data: DataConfig,
    rollout: RolloutConfig,
    reward: RewardConfig,
    heldout: EvalConfig,
    sandbox: SandboxConfig,
    template_pack_uri: str,
    iteration: int,
    log_samples: int,
) -> float:
    """Held-out accuracy of policy version ``iteration``: mean ``correct`` (a rule scorer's verdict, or
    score ≥ ``reward.correct_threshold``), the same rule as eval's. ``heldout``: the ``eval`` section;
    ``log_samples``: ``tracking.log_samples``."""
    cfg = Sections(data, rollout, reward, heldout, sandbox)
    return run_validation(session_of(ctx), ctx, cfg, template_pack_uri, iteration, log_samples)


def run_validation(
    session: RLSession,
    ctx: RunContext,
    cfg: Sections,
    template_pack_uri: str,
    iteration: int,
    log_samples: int,
) -> float:
    """:func:`validate`'s body, on the run's open RL session."""
    store = ctx.store()
    # 1. Skip when committed for this policy version
    params = {
        "iteration": iteration,
        "lineage": session.lineage,
        "rollout": cfg.rollout.model_dump(mode="json", exclude=PLACEMENT_FIELDS["rollout"]),
        "reward": cfg.reward.model_dump(mode="json"),
        "max_val": cfg.data.max_val_samples,
        "max_response_length": cfg.data.max_response_length,
        "pass_at_k": _pass_at_k_params(cfg.heldout),
    }
    stage = store.open_stage(
        ctx.run_id, iteration_stage(iteration, "val"), params=params, inputs={"prompts": template_pack_uri}
    )
    done = main_value(stage.manifest.summary["accuracy"] if stage.done and stage.manifest else None)
    if done is not None:
        return float(done)
    if session.version != iteration:
        raise RuntimeError(
            f"validation at iteration {iteration} needs policy version {iteration}, have {session.version}"
        )

    # 2. Generate on the held-out prompts: greedy, and eval.k samples each when eval.k > 1
    prompts = store.read_table(store.read_manifest(template_pack_uri), PROMPTS)
    max_len = cfg.data.max_response_length
    passes = {"": sampling_params(cfg.rollout, max_len, iteration, validation=True)}
    sampled = sampled_sampling(cfg.heldout, max_len, cfg.rollout.stop)
    if sampled is not None:
        passes["sampled/"] = sampled
    ids = prompts.column("input_ids").to_pylist()
    generated = generate_passes(
        session.engine, session.tokenizer, ids, passes, cfg.rollout.multi_turn, max_len, cfg.sandbox
    )

    # 3. Score, write, commit, log (once; every process returns the committed accuracy)
    return float(
        commit_once(lambda: _commit(ctx, cfg, stage, prompts, generated, iteration, session, log_samples))
    )


def _commit(
    ctx: RunContext,
    cfg: Sections,
    stage: StageWriter,
    prompts: pa.Table,
    generated: dict[str, Generated],
    iteration: int,
    session: RLSession,
    log_samples_n: int,
) -> float:
    """Score the passes, write and commit them, log the metrics and samples; returns the accuracy."""
    scored = score_passes(
        stage, prompts, generated, session.scorers(cfg.reward, cfg.sandbox),
        reward=cfg.reward, sandbox=cfg.sandbox, max_response_length=cfg.data.max_response_length,
        iteration=iteration, policy_version=session.engine.policy_version,
    )  # fmt: skip
    greedy, result = scored[""], scored[""].result
    n = max(1, greedy.batch.size)
    metrics = {
        "val/accuracy": greedy.accuracy,
        "val/reward_mean": sum(result.scores) / n,
        "val/response_length": sum(greedy.rollouts.column("response_length").to_pylist()) / n,
        "timing_s/validate_generate": generated[""].seconds,
        "timing_s/validate_sample": generated["sampled/"].seconds if "sampled/" in generated else 0.0,
        **{f"val/{k}": v for k, v in generated[""].rollouts.metrics.items()},
    }
    if "reward/no_answer_frac" in result.metrics:  # only a rule scorer extracts answers
        metrics["val/no_answer_frac"] = result.metrics["reward/no_answer_frac"]
    if "sampled/" in scored:  # MLflow names: no '@'
        metrics.update({f"val/pass_at_{k}": scored["sampled/"].pass_at(k) for k in (1, cfg.heldout.k)})
    stage.commit(summary={"accuracy": greedy.accuracy, "iteration_lineage": session.lineage, **metrics})
    tracker = ctx.tracker()
    tracker.log_metrics(metrics, step=iteration)
    if log_samples_n:
        columns = sample_columns(greedy.rollouts, result.scores, log_samples_n)
        log_samples(tracker, "val", iteration, columns)
    return greedy.accuracy


def _pass_at_k_params(e: EvalConfig) -> dict[str, float] | None:
    """What the sampled pass depends on (None: ``eval.k`` = 1, no sampled pass)."""
    return None if e.k == 1 else {"k": e.k, "temperature": e.temperature, "top_p": e.top_p, "seed": e.seed}
