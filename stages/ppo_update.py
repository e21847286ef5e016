"""PPO / GRPO update stage: rollouts + rewards → :func:`verl_core.training.ppo.ppo_iteration`.

Writes ``iter-XXXX/update/update.parquet`` (per-sample score, advantages, returns, KL), logs the first
``tracking.log_samples`` samples (prompt, response, score, mean advantage) as a table, and moves the
in-memory policy from version i to i+1. The new weights live in memory until the next checkpoint
(every ``trainer.save_freq`` iterations), so the stage's manifest is sealed, not published: the
checkpoint that makes the weights durable publishes it (see :mod:`stages.floor.state`). A committed
update is therefore always covered by a checkpoint and never runs again; an uncommitted one is re-run
after a crash, and being deterministic writes the same table.

Weight sync: right after the update the rollout engine receives policy i+1
(:func:`stages.floor.state.sync_rollout_weights`, logged as ``timing_s/weight_sync``). Before it, the
update refuses rollouts sampled by a policy more than ``trainer.rollout_ahead`` versions behind the
trainer's (their ``policy_version`` column is the version the engine held): a stale engine fails
loudly instead of training silently off-policy.

Dynamic sampling (``algorithm.filter_groups``): the update gets the rollout and reward URIs of every
generation batch of the iteration and trains on their kept rows (``group_filter.parquet`` of each
reward stage), concatenated in batch order: one combined batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
from prefect import task
from torch import Tensor

from stages.floor.builders import ppo_spec, update_seed
from stages.floor.locations import iteration_stage
from stages.floor.samples import log_samples, sample_columns
from stages.floor.state import get_state, ppo_models, sync_rollout_weights
from verl_core.algorithms.stats import masked_mean
from verl_core.config import VerlFlowConfig
from verl_core.errors import DataError
from verl_core.ranks import broadcast_from_main, is_main
from verl_core.run import RunContext
from verl_core.store import ArtifactStore
from verl_core.training.ppo import RolloutBatch, ppo_iteration


@task(name="ppo_update")
def ppo_update(
    ctx: RunContext,
    cfg: VerlFlowConfig,
    rollout_uri: str | Sequence[str],
    reward_uri: str | Sequence[str],
    iteration: int,
) -> str:
    """One PPO/GRPO iteration's update; returns the stage's manifest URI. Lists of URIs: the
    generation batches of a dynamically sampled iteration, trained on their kept rows."""
    store, state = ctx.store(), get_state(ctx)
    # 1. Skip only when the policy in memory already includes this update
    params = {k: cfg.section_without_placement(k) for k in ("actor", "critic", "algorithm", "model")}
    stage = store.open_stage(
        ctx.run_id,
        iteration_stage(iteration, "update"),
        params={"iteration": iteration, **params},
        inputs=_inputs(rollout_uri, reward_uri),
        force=state.version == iteration,
    )
    if broadcast_from_main(stage.done):  # rank 0 decides for every rank of an SPMD job
        return stage.manifest_uri
    if state.version != iteration:
        raise RuntimeError(
            f"update of iteration {iteration} needs policy version {iteration}, have {state.version}"
        )

    # 2. Read rollouts and rewards into one typed batch (ReMax's greedy baseline rows set apart)
    rollouts, rewards, selected = _read_batch(store, rollout_uri, reward_uri)
    source = rollout_uri if isinstance(rollout_uri, str) else " + ".join(rollout_uri)
    check_policy_lag(rollouts, state.version, cfg.trainer.rollout_ahead, iteration, source)
    try:
        batch = RolloutBatch.from_tables(rollouts, rewards)
    except ValueError as err:
        raise DataError(f"ppo_update: iteration {iteration}: {source} + {reward_uri}: {err}") from err
    if cfg.algorithm.greedy_baseline and batch.baseline_scores is None:
        raise DataError(
            f"ppo_update: iteration {iteration}: {source} has no greedy baseline rows (is_baseline), "
            "which algorithm.adv_estimator=remax needs: roll out with greedy_baseline=True"
        )

    # 3. The iteration: old/ref log-probs, values, advantages, critic and actor epochs
    result = ppo_iteration(
        ppo_models(state),
        batch,
        ppo_spec(cfg, iteration),
        kl_ctrl=state.kl_ctrl,
        seed=update_seed(cfg, iteration),
        where=f"ppo_update: iteration {iteration}",
    )

    # 4. Advance the policy version; the rollout engine receives it before the next rollout (every
    # rank of an SPMD job: gathering a sharded policy is a collective)
    state.version = iteration + 1
    sync_s = sync_rollout_weights(state)

    if not is_main():  # every rank holds the new weights (its shard) and synced its engine; rank 0 writes
        return stage.manifest_uri

    # 5. Write the per-sample table, log metrics; the next checkpoint commits
    stage.write_table(
        "update.parquet", _update_table(batch, result.advantages, result.returns, result.kl), "update"
    )
    summary = {"policy_version": state.version, **{k: result.metrics[k] for k in sorted(result.metrics)}}
    sampling: dict[str, int] = {}
    if selected is not None:  # dynamic sampling: generation batches (verl's metric name), groups kept
        sampling = {
            "train/num_gen_batches": len(rollout_uri),
            "train/kept_groups": len(set(batch.group_ids.tolist())),
        }
    summary |= {k.removeprefix("train/"): v for k, v in sampling.items()}
    state.pending.append(stage.seal(summary))  # published by the next checkpoint
    tracker = ctx.tracker()
    tracker.log_metrics({**result.metrics, **sampling, "timing_s/weight_sync": sync_s}, step=iteration)
    if cfg.tracking.log_samples:
        advantage = masked_mean(result.advantages, batch.response_mask, dim=-1).tolist()  # (S,) mean
        columns = sample_columns(rollouts, batch.scores.tolist(), cfg.tracking.log_samples, advantage)
        log_samples(tracker, "train", iteration, columns)
    return stage.manifest_uri


def _inputs(rollout_uri: str | Sequence[str], reward_uri: str | Sequence[str]) -> dict[str, str]:
    if isinstance(rollout_uri, str) and isinstance(reward_uri, str):
        return {"rollout": rollout_uri, "reward": reward_uri}
    r, w = list(rollout_uri), list(reward_uri)
    return {
        **{f"rollout/gen-{k}": uri for k, uri in enumerate(r)},
        **{f"reward/gen-{k}": uri for k, uri in enumerate(w)},
    }


def _read_batch(
    store: ArtifactStore, rollout_uri: str | Sequence[str], reward_uri: str | Sequence[str]
) -> tuple[pa.Table, pa.Table, pa.Table | None]:
    """The rollouts and rewards the update trains on, and (dynamic sampling) the group filters of
    every generation batch (None for one batch). Generation batches: their kept rows, in batch order."""
    if isinstance(rollout_uri, str) and isinstance(reward_uri, str):
        rollouts = store.read_table(store.read_manifest(rollout_uri), "rollouts.parquet")
        return rollouts, store.read_table(store.read_manifest(reward_uri), "rewards.parquet"), None
    if len(rollout_uri) != len(reward_uri) or not rollout_uri:
        raise DataError(
            f"ppo_update: {len(rollout_uri)} rollout and {len(reward_uri)} reward generation batches"
        )
    parts: list[tuple[pa.Table, pa.Table, pa.Table]] = []
    for r, w in zip(rollout_uri, reward_uri, strict=True):
        scored = store.read_manifest(w)
        parts.append(
            (
                store.read_table(store.read_manifest(r), "rollouts.parquet"),
                store.read_table(scored, "rewards.parquet"),
                store.read_table(scored, "group_filter.parquet"),
            )
        )
    filters = pa.concat_tables([f for _, _, f in parts])
    kept = filters.column("kept")
    rollouts = pa.concat_tables([r for r, _, _ in parts]).filter(kept)
    return rollouts, pa.concat_tables([w for _, w, _ in parts]).filter(kept), filters


def check_policy_lag(
    rollouts: pa.Table, trainer_version: int, rollout_ahead: int, iteration: int, rollout_uri: str
) -> None:
    """Refuse rollouts whose oldest ``policy_version`` lags ``trainer_version`` by more than
    ``rollout_ahead`` (or is newer than the trainer's, which no sync can produce)."""
    oldest = pc.min(rollouts.column("policy_version")).as_py()
    newest = pc.max(rollouts.column("policy_version")).as_py()
    if oldest is None:
        return
    if trainer_version - oldest > rollout_ahead or newest > trainer_version:
        bad = oldest if trainer_version - oldest > rollout_ahead else newest
        raise DataError(
            f"ppo_update: iteration {iteration}: {rollout_uri} was sampled with policy version {bad}, "
            f"but the trainer is at version {trainer_version} and trainer.rollout_ahead={rollout_ahead} "
            "allows a rollout at most that many versions behind: the rollout engine did not receive the "
            "updated weights (weight sync), or the rollout is from another run"
        )


def _update_table(batch: RolloutBatch, adv: Tensor, returns: Tensor, kl: Tensor | None) -> pa.Table:
    """One row per training sample (kind "update"): per-token values cut to the response length."""
    lengths = [len(r) for r in batch.response_ids]

    def rows(t: Tensor | None) -> list[list[float]]:
        if t is None:
            return [[] for _ in lengths]
        return [t[i, :n].tolist() for i, n in enumerate(lengths)]

    return pa.table(
        {
            "group_id": pa.array(batch.group_ids.tolist(), pa.int64()),
            "sample_index": pa.array(batch.sample_index.tolist(), pa.int32()),
            "score": pa.array(batch.scores.tolist(), pa.float32()),
            "advantages": pa.array(rows(adv), pa.list_(pa.float32())),
            "returns": pa.array(rows(returns), pa.list_(pa.float32())),
            "kl": pa.array(rows(kl), pa.list_(pa.float32())),
        }
    )
