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

The passes are :mod:`stages.floor.heldout`'s (eval makes the same); the scorers are built on the RL
loop's first call and reused (:func:`stages.floor.scorers.run_scorers`)."""

from __future__ import annotations

import pyarrow as pa
from prefect import task

from stages.floor.heldout import Generated, generate_passes, sampled_sampling, score_passes
from stages.floor.locations import iteration_stage
from stages.floor.rollouts import sampling_params
from stages.floor.samples import log_samples, sample_columns
from stages.floor.scorers import run_scorers
from stages.floor.spmd import commit_once, main_value
from stages.floor.state import RLState, get_state
from verl_core.config import VerlFlowConfig
from verl_core.runtime.run import RunContext
from verl_core.store import StageWriter

PROMPTS = "prompt_tokens/val.parquet"


@task(name="validate")
def validate(ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, iteration: int) -> float:
    """Held-out accuracy of policy version ``iteration``: mean ``correct`` (a rule scorer's verdict, or
    score ≥ ``reward.correct_threshold``), the same rule as eval's."""
    store = ctx.store()
    state = get_state(ctx)
    # 1. Skip when committed for this policy version
    params = {
        "iteration": iteration,
        "lineage": state.lineage,
        "rollout": cfg.section_without_placement("rollout"),
        "reward": cfg.reward.model_dump(mode="json"),
        "max_val": cfg.data.max_val_samples,
        "max_response_length": cfg.data.max_response_length,
        "pass_at_k": _pass_at_k_params(cfg),
    }
    stage = store.open_stage(
        ctx.run_id, iteration_stage(iteration, "val"), params=params, inputs={"prompts": template_pack_uri}
    )
    done = main_value(stage.manifest.summary["accuracy"] if stage.done and stage.manifest else None)
    if done is not None:
        return float(done)
    if state.version != iteration:
        raise RuntimeError(
            f"validation at iteration {iteration} needs policy version {iteration}, have {state.version}"
        )

    # 2. Generate on the held-out prompts: greedy, and eval.k samples each when eval.k > 1
    prompts = store.read_table(store.read_manifest(template_pack_uri), PROMPTS)
    max_len = cfg.data.max_response_length
    passes = {"": sampling_params(cfg.rollout, max_len, iteration, validation=True)}
    sampled = sampled_sampling(cfg.eval, max_len, cfg.rollout.stop)
    if sampled is not None:
        passes["sampled/"] = sampled
    ids = prompts.column("input_ids").to_pylist()
    generated = generate_passes(
        state.engine, state.tokenizer, ids, passes, cfg.rollout.multi_turn, max_len, cfg.sandbox
    )

    # 3. Score, write, commit, log (once; every process returns the committed accuracy)
    return float(commit_once(lambda: _commit(ctx, cfg, stage, prompts, generated, iteration, state)))


def _commit(
    ctx: RunContext,
    cfg: VerlFlowConfig,
    stage: StageWriter,
    prompts: pa.Table,
    generated: dict[str, Generated],
    iteration: int,
    state: RLState,
) -> float:
    """Score the passes, write and commit them, log the metrics and samples; returns the accuracy."""
    scored = score_passes(
        stage, prompts, generated, run_scorers(ctx.run_id, cfg.reward, cfg.sandbox),
        reward=cfg.reward, sandbox=cfg.sandbox, max_response_length=cfg.data.max_response_length,
        iteration=iteration, policy_version=state.engine.policy_version,
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
        metrics.update({f"val/pass_at_{k}": scored["sampled/"].pass_at(k) for k in (1, cfg.eval.k)})
    stage.commit(summary={"accuracy": greedy.accuracy, "iteration_lineage": state.lineage, **metrics})
    tracker = ctx.tracker()
    tracker.log_metrics(metrics, step=iteration)
    if cfg.tracking.log_samples:
        columns = sample_columns(greedy.rollouts, result.scores, cfg.tracking.log_samples)
        log_samples(tracker, "val", iteration, columns)
    return greedy.accuracy


def _pass_at_k_params(cfg: VerlFlowConfig) -> dict[str, float] | None:
    """What the sampled pass depends on (None: ``eval.k`` = 1, no sampled pass)."""
    e = cfg.eval
    return None if e.k == 1 else {"k": e.k, "temperature": e.temperature, "top_p": e.top_p, "seed": e.seed}
