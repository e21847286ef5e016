"""Reward stage of RL iteration i: score the iteration's rollouts.

Reads ``rollouts.parquet`` (kind "rollouts") of the rollout stage and writes, in stage
``iter-{i:04d}/reward``,

    rewards.parquet   kind "rewards": row j scores row j of the rollouts (score, components by scorer,
                      extracted_answer, correct)
    report.json       the metrics below, the scorers and weights, the errors zeroed (first few)

and logs verl-style metrics at step i (``critic/score/*``, ``reward/accuracy``, ``reward/no_answer_frac``,
``reward/errors``, ``response_length/*``, ``timing_s/reward``: the seconds the scoring took, also the
manifest summary's ``seconds``). The scoring itself is :func:`verl_core.reward.score_rollouts`;
:func:`stages.floor.builders.build_scorers` turns ``reward.*`` into scorers.
"""

from __future__ import annotations

import time

from prefect import task

from stages.floor.builders import score_batch
from stages.floor.locations import iteration_stage
from stages.floor.logging import stage_logger
from verl_core.config import RewardConfig, SandboxConfig
from verl_core.errors import DataError
from verl_core.reward import batch_from_columns, metrics_of_rows, rewards_table
from verl_core.run import RunContext

ROLLOUTS_FILE = "rollouts.parquet"
REWARDS_FILE = "rewards.parquet"


@task(name="reward")
def reward(
    ctx: RunContext,
    cfg: RewardConfig,
    rollout_uri: str,
    iteration: int,
    max_response_length: int,
    *,
    sandbox: SandboxConfig,
) -> str:
    """Score the rollouts at ``rollout_uri``; returns the reward stage's manifest URI. ``sandbox``: where
    the code scorer runs code (part of the stage's inputs only when that scorer is used)."""
    log = stage_logger(__name__)
    store = ctx.store()
    # 1. Skip when committed with the same inputs
    params = {"reward": cfg.model_dump(mode="json"), "max_response_length": max_response_length}
    if any(s.name == "code" for s in cfg.scorers):
        params["sandbox"] = sandbox.model_dump(mode="json")
    stage = store.open_stage(
        ctx.run_id, iteration_stage(iteration, "reward"), params=params, inputs={"rollout": rollout_uri}
    )
    if stage.done:
        log.info("reward: iteration %d already committed, skipping", iteration)
        return stage.manifest_uri

    # 2. Read the rollouts
    rollouts = store.read_table(store.read_manifest(rollout_uri), ROLLOUTS_FILE)
    if rollouts.num_rows == 0:
        raise DataError(f"reward: {rollout_uri} has no rollouts to score")
    batch = batch_from_columns(rollouts)

    # 3. Build the scorers and score
    t0 = time.perf_counter()
    result = score_batch(cfg, sandbox, batch, max_response_length)
    seconds = time.perf_counter() - t0
    metrics = result.metrics
    baseline = rollouts.column("is_baseline").to_pylist()
    if any(baseline):  # ReMax's greedy rows: scored (the update's baselines), kept out of the metrics
        metrics = metrics_of_rows(batch, result, [i for i, b in enumerate(baseline) if not b])
        metrics["reward/baseline_score/mean"] = sum(
            s for s, b in zip(result.scores, baseline, strict=True) if b
        ) / sum(baseline)

    # 4. Write the rewards and the report, commit
    stage.write_table(REWARDS_FILE, rewards_table(batch, result), "rewards")
    zeroed = [
        {"row": batch.row_name(i), "data_source": batch.data_source[i], "error": e}
        for i, e in enumerate(result.errors)
        if e is not None
    ]
    report = {
        "iteration": iteration,
        "rows": batch.size,
        "scorers": {s.name: s.weight for s in cfg.scorers},
        "metrics": metrics,
        "errors": len(zeroed),
        "error_examples": zeroed[:20],
    }
    stage.write_json("report.json", report)
    summary = {"iteration": iteration, "rows": batch.size, "metrics": metrics, "seconds": seconds}
    uri = stage.commit(summary=summary)

    # 5. Metrics
    ctx.tracker().log_metrics({**metrics, "timing_s/reward": seconds}, step=iteration)
    log.info(
        "reward: iteration %d, %d rows, score mean %.4f, %d errors zeroed",
        iteration, batch.size, metrics["critic/score/mean"], len(zeroed),
    )  # fmt: skip
    return uri
