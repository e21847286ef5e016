"""Reward stage of RL iteration i: score the iteration's rollouts.

Reads ``rollouts.parquet`` (kind "rollouts") of the rollout stage and writes, in stage
``iter-{i:04d}/reward``,

    rewards.parquet   kind "rewards": row j scores row j of the rollouts (score, components by scorer,
                      extracted_answer, correct)
    report.json       the metrics below, the scorers and weights, the errors zeroed (first few)

and logs verl-style metrics at step i (``critic/score/*``, ``reward/accuracy``, ``reward/no_answer_frac``,
``reward/errors``, ``response_length/*``, ``timing_s/reward``: the seconds the scoring took, also the
manifest summary's ``seconds``), but not ``critic/score/mean`` and ``response_length/mean``
(``UPDATE_LOGS``), which the update logs at that step for the batch it trains on.

Dynamic sampling (``algorithm.filter_groups``): generation batch K is scored in
``iter-XXXX/reward/gen-K``, which also writes ``group_filter.parquet`` (kind "group_filter": the
metric's value per row and ``kept``, :func:`verl_core.algorithms.dynamic_sampling.filter_groups` with
the groups the iteration still wants) and puts the counts in its summary under ``filter``; it logs
nothing: its metrics go to the summary (``DEFERRED_METRICS``) and :mod:`flows.sampling` logs the
iteration's batches combined, once per step.

The scoring itself is :func:`verl_core.reward.score_rollouts`;
:func:`stages.floor.scorers.build_scorers` turns ``reward.*`` into scorers; inside the RL loop they are
the RL session's, built once per loop (:func:`stages.floor.session.loop_scorers`).
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa
from prefect import task

from stages.floor.locations import generation_stage, iteration_stage
from stages.floor.logging import DEFERRED_METRICS, stage_logger
from stages.floor.retry import retry_unless_deterministic
from stages.floor.scorers import score_batch
from stages.floor.session import loop_scorers
from verl_core.algorithms.dynamic_sampling import FILTER_METRICS, filter_groups
from verl_core.config import RewardConfig, SandboxConfig
from verl_core.errors import DataError
from verl_core.reward import RewardBatch, RewardResult, batch_from_columns, metrics_of_rows, rewards_table
from verl_core.runtime.run import RunContext

ROLLOUTS_FILE = "rollouts.parquet"
REWARDS_FILE = "rewards.parquet"
FILTER_FILE = "group_filter.parquet"
# logged at the same step by the update (verl_core.training.ppo_metrics.batch_metrics), of the batch it
# trains on (dynamic sampling: the kept groups); the stage's summary keeps its own values
UPDATE_LOGS = frozenset({"critic/score/mean", "response_length/mean"})


@task(name="reward", retry_condition_fn=retry_unless_deterministic)
def reward(
    ctx: RunContext,
    cfg: RewardConfig,
    rollout_uri: str,
    iteration: int,
    max_response_length: int,
    *,
    sandbox: SandboxConfig,
    gen_batch: int | None = None,
    filter_metric: str = "acc",
    wanted_groups: int = 0,
) -> str:
    """Score the rollouts at ``rollout_uri``; returns the reward stage's manifest URI. ``sandbox``: where
    the code scorer runs code (part of the stage's inputs only when that scorer is used).
    ``gen_batch``: generation batch K of a dynamically sampled iteration; its groups are filtered by
    ``filter_metric`` (verl's ``acc`` | ``score``), keeping at most ``wanted_groups`` informative ones."""
    log = stage_logger(__name__)
    store = ctx.store()
    # 1. Skip when committed with the same inputs
    params = {"reward": cfg.model_dump(mode="json"), "max_response_length": max_response_length}
    if any(s.name == "code" for s in cfg.scorers):
        params["sandbox"] = sandbox.model_dump(mode="json")
    where = iteration_stage(iteration, "reward")
    if gen_batch is not None:
        if filter_metric not in FILTER_METRICS:
            raise ValueError(f"filter metric must be one of {sorted(FILTER_METRICS)}, got {filter_metric!r}")
        params |= {"gen_batch": gen_batch, "filter_metric": filter_metric, "wanted_groups": wanted_groups}
        where = generation_stage(iteration, "reward", gen_batch)
    stage = store.open_stage(ctx.run_id, where, params=params, inputs={"rollout": rollout_uri})
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
    result = score_batch(cfg, sandbox, batch, max_response_length, loop_scorers(ctx, cfg, sandbox))
    seconds = time.perf_counter() - t0
    metrics = result.metrics
    baseline = rollouts.column("is_baseline").to_pylist()
    if any(baseline):  # ReMax's greedy rows: scored (the update's baselines), kept out of the metrics
        metrics = metrics_of_rows(batch, result, [i for i, b in enumerate(baseline) if not b])
        metrics["reward/baseline_score/mean"] = sum(
            s for s, b in zip(result.scores, baseline, strict=True) if b
        ) / sum(baseline)

    # 4. Write the rewards (dynamic sampling: and which groups train) and the report, commit
    table = rewards_table(batch, result)
    stage.write_table(REWARDS_FILE, table, "rewards")
    kept = None
    if gen_batch is not None:
        kept = _filter_groups(table, filter_metric, wanted_groups)
        stage.write_table(FILTER_FILE, kept[0], "group_filter")
    report = _report(cfg, batch, result, metrics, iteration)
    stage.write_json("report.json", report)
    summary = {"iteration": iteration, "rows": batch.size, "metrics": metrics, "seconds": seconds}
    # 5. Metrics (not those the update logs for the batch it trains on: each metric once per step; a
    # generation batch leaves them to flows.sampling, which logs the iteration's batches together)
    logged = {**{k: v for k, v in metrics.items() if k not in UPDATE_LOGS}, "timing_s/reward": seconds}
    if kept is not None:
        summary |= {"filter": kept[1], DEFERRED_METRICS: logged}
    uri = stage.commit(summary=summary)
    if kept is None:
        ctx.tracker().log_metrics(logged, step=iteration)
    log.info(
        "reward: iteration %d, %d rows, score mean %.4f, %d errors zeroed",
        iteration, batch.size, metrics["critic/score/mean"], report["errors"],
    )  # fmt: skip
    return uri


def _report(
    cfg: RewardConfig, batch: RewardBatch, result: RewardResult, metrics: dict[str, float], iteration: int
) -> dict[str, Any]:
    """``report.json``: the metrics, the scorers and weights, the errors zeroed (the first 20)."""
    zeroed = [
        {"row": batch.row_name(i), "data_source": batch.data_source[i], "error": e}
        for i, e in enumerate(result.errors)
        if e is not None
    ]
    return {
        "iteration": iteration,
        "rows": batch.size,
        "scorers": {s.name: s.weight for s in cfg.scorers},
        "metrics": metrics,
        "errors": len(zeroed),
        "error_examples": zeroed[:20],
    }


def _filter_groups(rewards: pa.Table, metric: str, wanted_groups: int) -> tuple[pa.Table, dict[str, int]]:
    """The "group_filter" table of a generation batch's rewards and its counts (for the summary)."""
    groups = rewards.column("group_id").to_pylist()
    values = [float(v) for v in rewards.column(FILTER_METRICS[metric]).to_pylist()]  # acc: True → 1.0
    f = filter_groups(groups, values, wanted_groups)
    table = pa.table(
        {
            "group_id": rewards.column("group_id"),
            "sample_index": rewards.column("sample_index"),
            "value": pa.array(values, pa.float32()),
            "kept": pa.array(f.kept, pa.bool_()),
        }
    )
    counts = {
        "wanted_groups": wanted_groups,
        "kept_groups": f.kept_groups,
        "informative_groups": f.informative_groups,
        "uniform_groups": f.uniform_groups,
    }
    return table, counts
