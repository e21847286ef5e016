"""PPO / GRPO update stage: rollouts + rewards → :func:`verl_core.training.ppo.ppo_iteration`.

Writes ``iter-XXXX/update/update.parquet`` (per-sample score, advantages, returns, KL), logs the first
``tracking.log_samples`` samples (prompt, response, score, mean advantage) as a table, and moves the
in-memory policy from version i to i+1. The new weights live in memory until the next checkpoint (every
``trainer.save_freq`` iterations), so the stage's manifest is sealed, not published: the checkpoint that
makes the weights durable publishes it (see :mod:`stages.floor.checkpoint`). A committed update is therefore
always covered by a checkpoint and never runs again; an uncommitted one is re-run after a crash, and being
deterministic writes the same table.

Weight sync: the engine sleeps during the update if it can (:func:`~stages.floor.session.rest_engine`),
then wakes and gets policy i+1 (:func:`~stages.floor.session.advance_policy`, ``timing_s/weight_sync``).
First, the update refuses rollouts sampled by a policy more than ``trainer.rollout_ahead`` versions
behind the trainer's (their ``policy_version`` column is the engine's): a stale engine fails loudly.

Dynamic sampling (``algorithm.filter_groups``): the update gets the rollout and reward URIs of every
generation batch of the iteration and trains on their kept rows (``group_filter.parquet`` of each
reward stage), in batch order. Reading the batch, the lag check and the per-sample table are the
floor's (:mod:`stages.floor.artifacts`).

The task is a shell: it looks the run's RL session up once and hands it to :func:`run_update`. It takes
the whole config, nine sections (skip key: ``actor``, ``critic``, ``algorithm``, ``model``; PPO spec:
``rollout``, ``ref``, ``data``, ``trainer``; samples: ``tracking``): as parameters, a task mirroring it.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect import task

from stages.floor.artifacts import check_policy_lag, read_update_tables, update_inputs, update_table
from stages.floor.commit import commit_once, committed
from stages.floor.locations import iteration_stage
from stages.floor.samples import log_samples, sample_columns
from stages.floor.session import RLSession, advance_policy, ppo_models, rest_engine, seal_update, session_of
from stages.floor.specs import ppo_spec, update_seed
from verl_core.algorithms.stats import masked_mean
from verl_core.config import VerlFlowConfig
from verl_core.errors import DataError
from verl_core.runtime.run import RunContext
from verl_core.training.batch import RolloutBatch
from verl_core.training.ppo import ppo_iteration

URIs = str | Sequence[str]  # one stage's manifest URI, or a dynamically sampled iteration's batches'


@task(name="ppo_update")
def ppo_update(
    ctx: RunContext, cfg: VerlFlowConfig, rollout_uri: URIs, reward_uri: URIs, iteration: int
) -> str:
    """One PPO/GRPO iteration's update; returns the stage's manifest URI. Lists of URIs: the
    generation batches of a dynamically sampled iteration, trained on their kept rows."""
    return run_update(session_of(ctx), ctx, cfg, rollout_uri, reward_uri, iteration)


def run_update(
    session: RLSession, ctx: RunContext, cfg: VerlFlowConfig, rollout_uri: URIs, reward_uri: URIs,
    iteration: int,
) -> str:  # fmt: skip
    """:func:`ppo_update`'s body, on the run's open RL session."""
    store = ctx.store()
    # 1. Skip only when the policy in memory already includes this update
    params = {k: cfg.section_without_placement(k) for k in ("actor", "critic", "algorithm", "model")}
    stage = store.open_stage(
        ctx.run_id, iteration_stage(iteration, "update"), params={"iteration": iteration, **params},
        inputs=update_inputs(rollout_uri, reward_uri), force=session.version == iteration,
    )  # fmt: skip
    if committed(stage):
        return stage.manifest_uri
    if session.version != iteration:
        raise RuntimeError(
            f"update of iteration {iteration} needs policy version {iteration}, have {session.version}"
        )

    # 2. Read rollouts and rewards into one typed batch (ReMax's greedy baseline rows set apart)
    rollouts, rewards, selected = read_update_tables(store, rollout_uri, reward_uri)
    source = rollout_uri if isinstance(rollout_uri, str) else " + ".join(rollout_uri)
    check_policy_lag(rollouts, session.version, cfg.trainer.rollout_ahead, iteration, source)
    try:
        batch = RolloutBatch.from_tables(rollouts, rewards)
    except ValueError as err:
        raise DataError(f"ppo_update: iteration {iteration}: {source} + {reward_uri}: {err}") from err
    if cfg.algorithm.greedy_baseline and batch.baseline_scores is None:
        raise DataError(
            f"ppo_update: iteration {iteration}: {source} has no greedy baseline rows (is_baseline), "
            "which algorithm.adv_estimator=remax needs: roll out with greedy_baseline=True"
        )

    # 3. The iteration (old/ref log-probs, values, advantages, epochs), the rollout engine asleep
    rest_engine(session)
    result = ppo_iteration(
        ppo_models(session), batch, ppo_spec(cfg, iteration), kl_ctrl=session.kl_ctrl,
        seed=update_seed(cfg, iteration), where=f"ppo_update: iteration {iteration}",
    )  # fmt: skip

    # 4. Policy i+1, synced to the rollout engine (every rank: gathering a sharded policy is a collective)
    sync_s = advance_policy(session, iteration)

    # 5. The main rank writes the per-sample table, seals the manifest (published by the next
    # checkpoint) and logs; every rank returns the URI
    def seal() -> str:
        table = update_table(batch, result.advantages, result.returns, result.kl, result.old_log_probs)
        stage.write_table("update.parquet", table, "update")
        summary = {"policy_version": session.version, **dict(sorted(result.metrics.items()))}
        sampling: dict[str, int] = {}
        if selected is not None:  # dynamic sampling: generation batches (verl's metric name), groups kept
            sampling = {
                "train/num_gen_batches": len(rollout_uri),
                "train/kept_groups": len(set(batch.group_ids.tolist())),
            }
        summary |= {k.removeprefix("train/"): v for k, v in sampling.items()}
        seal_update(session, stage.seal(summary))
        tracker = ctx.tracker()
        tracker.log_metrics({**result.metrics, **sampling, "timing_s/weight_sync": sync_s}, step=iteration)
        if cfg.tracking.log_samples:
            advantage = masked_mean(result.advantages, batch.response_mask, dim=-1).tolist()  # (S,) mean
            columns = sample_columns(rollouts, batch.scores.tolist(), cfg.tracking.log_samples, advantage)
            log_samples(tracker, "train", iteration, columns)
        return stage.manifest_uri

    return commit_once(seal)
