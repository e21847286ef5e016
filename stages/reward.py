"""Reward stage of RL iteration i: score the iteration's rollouts.

Reads ``rollouts.parquet`` (kind "rollouts") of the rollout stage and writes, in stage
``iter-{i:04d}/reward``,

    rewards.parquet   kind "rewards": row j scores row j of the rollouts (score, components by scorer,
                      extracted_answer, correct)
    report.json       the metrics below, the scorers and weights, the errors zeroed (first few)

and logs verl-style metrics at step i (``critic/score/*``, ``reward/accuracy``, ``reward/no_answer_frac``,
``reward/errors``, ``response_length/*``). The scoring itself is :func:`verl_core.reward.score_rollouts`;
:func:`build_scorers` turns ``reward.*`` into scorers, for the RL loop as well.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import task

from stages.progress import stage_logger
from verl_core.algorithms.registry import Registry
from verl_core.config import RewardConfig
from verl_core.errors import DataError
from verl_core.reward import (
    FunctionScorer,
    RuleOptions,
    RuleScorer,
    Scorer,
    WeightedScorer,
    batch_from_columns,
    load_reward_function,
    rewards_table,
    score_rollouts,
)
from verl_core.run import RunContext

ROLLOUTS_FILE = "rollouts.parquet"
REWARDS_FILE = "rewards.parquet"


def stage_name(iteration: int) -> str:
    return f"iter-{iteration:04d}/reward"


@task(name="reward")
def reward(
    ctx: RunContext, cfg: RewardConfig, rollout_uri: str, iteration: int, max_response_length: int
) -> str:
    """Score the rollouts at ``rollout_uri``; returns the reward stage's manifest URI."""
    log = stage_logger(__name__)
    store = ctx.store()
    # 1. Skip when committed with the same inputs
    params = {"reward": cfg.model_dump(mode="json"), "max_response_length": max_response_length}
    stage = store.open_stage(
        ctx.run_id, stage_name(iteration), params=params, inputs={"rollout": rollout_uri}
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
    result = score_rollouts(
        batch,
        build_scorers(cfg),
        on_error=cfg.on_error,
        max_response_length=max_response_length,
        overlong_buffer_len=cfg.overlong_buffer_len,
        overlong_penalty_factor=cfg.overlong_penalty_factor,
    )

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
        "metrics": result.metrics,
        "errors": len(zeroed),
        "error_examples": zeroed[:20],
    }
    stage.write_json("report.json", report)
    uri = stage.commit(summary={"iteration": iteration, "rows": batch.size, "metrics": result.metrics})

    # 5. Metrics
    ctx.tracker().log_metrics(result.metrics, step=iteration)
    log.info(
        "reward: iteration %d, %d rows, score mean %.4f, %d errors zeroed",
        iteration, batch.size, result.metrics["critic/score/mean"], len(zeroed),
    )  # fmt: skip
    return uri


# --------------------------------------------------------------------------------------------------
# Scorers from the config: one builder per scorer name

SCORER_BUILDERS: Registry[Callable[[RewardConfig], Scorer]] = Registry("reward scorer")


@SCORER_BUILDERS.register("rule")
def _rule(cfg: RewardConfig) -> Scorer:
    options = RuleOptions(cfg.gsm8k_method, cfg.score, cfg.format_score)
    return RuleScorer(options, cfg.num_workers, cfg.parallel_min_samples)


@SCORER_BUILDERS.register("function")
def _function(cfg: RewardConfig) -> Scorer:
    assert cfg.function is not None  # the config requires it with this scorer
    return FunctionScorer(load_reward_function(cfg.function), cfg.function_mode, cfg.timeout_s)


@SCORER_BUILDERS.register("model")
def _model(cfg: RewardConfig) -> Scorer:
    from verl_core.models.loading import resolve_device
    from verl_core.reward.model import ModelScorer, load_reward_scorer

    assert cfg.model_path is not None  # the config requires it with this scorer
    device = resolve_device(cfg.model_device)
    model, tokenizer = load_reward_scorer(cfg.model_path, dtype=cfg.model_dtype, device=device)
    return ModelScorer(model, tokenizer, cfg.model_max_tokens_per_batch)


def build_scorers(cfg: RewardConfig) -> list[WeightedScorer]:
    """The weighted scorers of ``reward.scorers`` (loads the function / reward model they name)."""
    return [WeightedScorer(s.name, s.weight, SCORER_BUILDERS.get(s.name)(cfg)) for s in cfg.scorers]
