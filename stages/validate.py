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
the same random numbers and the curve shows the policy's change, not sampling noise."""

from __future__ import annotations

import time

import pyarrow as pa
from prefect import task

from stages.floor.artifacts import rollouts_table
from stages.floor.builders import Rollouts, sampling_params, score_batch, sharded_rollouts
from stages.floor.locations import iteration_stage
from stages.floor.samples import log_samples, sample_columns
from stages.floor.state import get_state
from verl_core.algorithms.evaluation import pass_at_k, per_prompt_correct
from verl_core.config import VerlFlowConfig
from verl_core.reward import batch_from_columns, rewards_table
from verl_core.rollout import SamplingParams
from verl_core.runtime.ranks import broadcast_from_main, is_main
from verl_core.runtime.run import RunContext
from verl_core.store import StageWriter


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
    done = broadcast_from_main(stage.manifest.summary["accuracy"] if stage.done and stage.manifest else None)
    if done is not None:  # rank 0 decides for every rank of an SPMD job
        return float(done)
    if state.version != iteration:
        raise RuntimeError(
            f"validation at iteration {iteration} needs policy version {iteration}, have {state.version}"
        )

    # 2. Generate on the held-out prompts
    prompts = store.read_table(store.read_manifest(template_pack_uri), "prompt_tokens/val.parquet")
    t0 = time.perf_counter()
    completions, trajectories, turn_metrics = sharded_rollouts(
        state.engine,
        state.tokenizer,
        prompts.column("input_ids").to_pylist(),
        sampling_params(cfg.rollout, cfg.data.max_response_length, iteration, validation=True),
        cfg.rollout.multi_turn,
        cfg.data.max_response_length,
        cfg.sandbox,
    )
    gen_s, t0 = time.perf_counter() - t0, time.perf_counter()
    sampled = None
    if cfg.eval.k > 1:  # every rank makes the same calls (sharded_rollouts gathers)
        sampled = sharded_rollouts(
            state.engine, state.tokenizer, prompts.column("input_ids").to_pylist(), _pass_at_k_sampling(cfg),
            cfg.rollout.multi_turn, cfg.data.max_response_length, cfg.sandbox,
        )  # fmt: skip
    sample_s = time.perf_counter() - t0
    if not is_main():  # every rank generated its share; rank 0 scores and commits
        return float(broadcast_from_main(0.0))
    rollouts = rollouts_table(
        completions, prompts, iteration, policy_version=state.engine.policy_version, trajectories=trajectories
    )

    # 3. Score (the sampled pass too), write, commit
    batch = batch_from_columns(rollouts)
    result = score_batch(cfg.reward, cfg.sandbox, batch, cfg.data.max_response_length)
    n = max(1, len(completions))
    accuracy = sum(result.correct) / n  # the one accuracy rule (verl_core.reward.score_rollouts)
    lengths = rollouts.column("response_length").to_pylist()
    metrics = {
        "val/accuracy": accuracy,
        "val/reward_mean": sum(result.scores) / n,
        "val/response_length": sum(lengths) / n,
        "timing_s/validate_generate": gen_s,
        "timing_s/validate_sample": sample_s,
        **{f"val/{k}": v for k, v in turn_metrics.items()},
    }
    if "reward/no_answer_frac" in result.metrics:  # only a rule scorer extracts answers
        metrics["val/no_answer_frac"] = result.metrics["reward/no_answer_frac"]
    stage.write_table("rollouts.parquet", rollouts, "rollouts")
    stage.write_table("rewards.parquet", rewards_table(batch, result), "rewards")
    if sampled is not None:  # pass@1 and pass@k of the eval.k samples per prompt
        version = state.engine.policy_version
        metrics.update(_score_sampled(cfg, stage, sampled, prompts, iteration, version))
    stage.commit(summary={"accuracy": accuracy, "iteration_lineage": state.lineage, **metrics})
    tracker = ctx.tracker()
    tracker.log_metrics(metrics, step=iteration)
    if cfg.tracking.log_samples:
        columns = sample_columns(rollouts, result.scores, cfg.tracking.log_samples)
        log_samples(tracker, "val", iteration, columns)
    return float(broadcast_from_main(accuracy))


def _score_sampled(
    cfg: VerlFlowConfig,
    stage: StageWriter,
    sampled: Rollouts,
    prompts: pa.Table,
    iteration: int,
    version: int,
) -> dict[str, float]:
    """Score the sampled pass, write ``sampled/{rollouts,rewards}.parquet``; ``val/pass_at_1`` and
    ``val/pass_at_{eval.k}``: the mean over prompts of the unbiased pass@k of each prompt's samples
    (the eval stage's rule)."""
    rollouts = rollouts_table(
        sampled.completions, prompts, iteration, policy_version=version, trajectories=sampled.trajectories
    )
    batch = batch_from_columns(rollouts)
    result = score_batch(cfg.reward, cfg.sandbox, batch, cfg.data.max_response_length)
    counts = list(per_prompt_correct(batch.group_id, result.correct).values())  # (n, c) per prompt
    stage.write_table("sampled/rollouts.parquet", rollouts, "rollouts")
    stage.write_table("sampled/rewards.parquet", rewards_table(batch, result), "rewards")
    return {  # MLflow names: no '@'
        f"val/pass_at_{k}": sum(pass_at_k(n, c, k) for n, c in counts) / max(1, len(counts))
        for k in (1, cfg.eval.k)
    }


def _pass_at_k_params(cfg: VerlFlowConfig) -> dict[str, float] | None:
    """What the sampled pass depends on (None: ``eval.k`` = 1, no sampled pass)."""
    e = cfg.eval
    return None if e.k == 1 else {"k": e.k, "temperature": e.temperature, "top_p": e.top_p, "seed": e.seed}


def _pass_at_k_sampling(cfg: VerlFlowConfig) -> SamplingParams:
    """The eval stage's sampled pass: ``eval.k`` samples per prompt, seeded by ``eval.seed`` alone."""
    e = cfg.eval
    return SamplingParams(
        n=e.k, temperature=e.temperature, top_p=e.top_p, seed=e.seed,
        max_new_tokens=cfg.data.max_response_length, stop=tuple(cfg.rollout.stop),
    )  # fmt: skip
