"""Rollout stage: sample ``rollout.n`` responses per prompt of iteration i's batch with the current
policy; writes ``iter-XXXX/rollout/rollouts.parquet`` (kind "rollouts").

The batch of iteration i comes from a deterministic loader over ``prompt_tokens/train``: one seeded
permutation per epoch, batches taken in order across epoch boundaries, so the same iteration always
sees the same prompts (a resumed run included). Sampling is seeded by (rollout.seed, i) and, per
sample, by the prompt's index in the batch (its key) and the sample index, so a rank generating a
shard of the batch draws the samples one process would. Each row records the policy version the
rollout engine held (``ppo_update`` refuses a batch too far behind the trainer's).

Dynamic sampling (``algorithm.filter_groups``): the iteration samples generation batches
``iter-XXXX/rollout/gen-K``, each of ``data.train_batch_size`` prompts from the prompt stream's
``cursor`` (:mod:`verl_core.data.prompt_stream`), seeded apart per K; their group ids continue
across batches (K·B + prompt), so the batches of an iteration concatenate into one.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import pyarrow as pa
from prefect import task

from stages.floor.artifacts import rollouts_table
from stages.floor.commit import commit_once, committed
from stages.floor.locations import generation_stage, iteration_stage
from stages.floor.logging import DEFERRED_METRICS
from stages.floor.rollouts import Rollouts, sampling_params, sharded_rollouts
from stages.floor.session import RLSession, rollout_version, session_of
from verl_core.config import PLACEMENT_FIELDS, DataConfig, RolloutConfig, SandboxConfig
from verl_core.data.prompt_stream import iteration_cursor, take_batch
from verl_core.rollout import Completion, SamplingParams
from verl_core.rollout.multi_turn import Trajectory
from verl_core.runtime.run import RunContext
from verl_core.seeding import derive_seed
from verl_core.store import StageWriter


@task(name="rollout")
def rollout(
    ctx: RunContext,
    data: DataConfig,
    cfg: RolloutConfig,
    template_pack_uri: str,
    iteration: int,
    lineage: str,
    greedy_baseline: bool = False,
    sandbox: SandboxConfig | None = None,
    *,
    gen_batch: int | None = None,
    cursor: int = 0,
) -> str:
    """Generate iteration ``iteration``'s rollouts with the in-memory policy (version = iteration, or
    iteration − 1 when ``trainer.rollout_ahead=1`` generates it alongside the previous update).
    ``greedy_baseline`` (ReMax): also one greedy response per prompt, a row marked ``is_baseline`` with
    ``sample_index = rollout.n``; it is scored like the others and used only as its group's baseline.
    ``gen_batch``: generation batch K of a dynamically sampled iteration, its prompts from the
    stream's position ``cursor`` (None: the iteration's one batch, from iteration·B)."""
    return run_rollout(
        session_of(ctx), ctx, data, cfg, template_pack_uri, iteration, lineage, greedy_baseline, sandbox,
        gen_batch=gen_batch, cursor=cursor,
    )  # fmt: skip


def run_rollout(
    session: RLSession,
    ctx: RunContext,
    data: DataConfig,
    cfg: RolloutConfig,
    template_pack_uri: str,
    iteration: int,
    lineage: str,
    greedy_baseline: bool = False,
    sandbox: SandboxConfig | None = None,
    *,
    gen_batch: int | None = None,
    cursor: int = 0,
) -> str:
    """:func:`rollout`'s body, on the run's open RL session."""
    store = ctx.store()
    # 1. Skip when committed for this iteration of this policy lineage
    stage = _open_stage(
        ctx, data, cfg, template_pack_uri, iteration, lineage, greedy_baseline, gen_batch, cursor
    )
    if committed(stage):
        return stage.manifest_uri
    lowest = rollout_version(session, iteration)  # rollout_ahead=1: the trainer may still be one behind
    if not lowest <= session.version <= iteration:
        wanted = f"{iteration}" if lowest == iteration else f"{lowest} or {iteration}"
        raise RuntimeError(
            f"rollout of iteration {iteration} needs policy version {wanted}, have {session.version}"
        )

    # 2. The iteration's prompts
    prompts = store.read_table(store.read_manifest(template_pack_uri), "prompt_tokens/train.parquet")
    b = data.train_batch_size
    start = cursor if gen_batch is not None else iteration_cursor(iteration, b)  # one batch: iteration·B
    taken = take_batch(prompts.num_rows, start, b, seed=data.seed, shuffle=data.shuffle)
    batch = prompts.take(taken.rows)

    # 3. Generate (every rank its share; every rank gets every rollout)
    sampling = sampling_params(cfg, data.max_response_length, iteration, validation=False)
    if gen_batch:  # batch K > 0 of the iteration draws apart from batch 0 (which draws as without filtering)
        sampling = replace(sampling, seed=derive_seed("rollout_gen_batch", cfg.seed, iteration, gen_batch))
    sampled = _generate(session, data, cfg, batch, sampling, greedy_baseline, sandbox)

    # 4. Write and commit on the main rank; every rank returns the URI
    where = _Where(iteration, taken.epoch, start, (gen_batch or 0) * b, gen_batch is not None)
    return commit_once(lambda: _commit(ctx, stage, batch, sampled, where, session.engine.policy_version))


class _Sampled(NamedTuple):
    """A rollout's generations: the samples, ReMax's greedy baselines (``sample_index = rollout.n``)
    and their trajectories (multi-turn), and the seconds the generation took."""

    main: Rollouts
    baselines: list[Completion]
    baseline_trajectories: list[Trajectory]
    seconds: float


class _Where(NamedTuple):
    """Where a rollout's rows sit: its iteration, the epoch and prompt-stream position of its batch,
    the group id of its first prompt (K·B for generation batch K), and whether it is a generation batch
    (its metrics are then logged by flows.sampling, with the iteration's other batches)."""

    iteration: int
    epoch: int
    prompt_cursor: int
    group_offset: int
    gen_batch: bool


def _open_stage(
    ctx: RunContext,
    data: DataConfig,
    cfg: RolloutConfig,
    template_pack_uri: str,
    iteration: int,
    lineage: str,
    greedy_baseline: bool,
    gen_batch: int | None,
    cursor: int,
) -> StageWriter:
    """The rollout stage of ``iteration`` (or of its generation batch ``gen_batch``), keyed by the
    policy lineage and every setting that changes what is sampled."""
    params = {
        "iteration": iteration,
        "lineage": lineage,
        "rollout": cfg.model_dump(mode="json", exclude=PLACEMENT_FIELDS["rollout"]),
        "batch": data.train_batch_size,
        "max_response_length": data.max_response_length,
        "seed": data.seed,
        "shuffle": data.shuffle,
        "greedy_baseline": greedy_baseline,
    }
    where = iteration_stage(iteration, "rollout")
    if gen_batch is not None:
        params |= {"gen_batch": gen_batch, "cursor": cursor}
        where = generation_stage(iteration, "rollout", gen_batch)
    return ctx.store().open_stage(
        ctx.run_id,
        where,
        params=params,
        inputs={"prompts": template_pack_uri},
    )


def _generate(
    session: RLSession,
    data: DataConfig,
    cfg: RolloutConfig,
    batch: pa.Table,
    sampling: SamplingParams,
    greedy_baseline: bool,
    sandbox: SandboxConfig | None,
) -> _Sampled:
    """Sample ``batch``'s prompts with the rollout engine (and, for ReMax, one greedy response each)."""
    t0 = time.perf_counter()
    ids = batch.column("input_ids").to_pylist()
    gen = partial(
        sharded_rollouts, session.engine, session.tokenizer, ids,
        multi_turn=cfg.multi_turn, max_response_length=data.max_response_length, sandbox=sandbox,
    )  # fmt: skip
    main = gen(sampling)
    baselines: list[Completion] = []
    baseline_traj: list[Trajectory] = []
    if greedy_baseline:
        greedy = gen(replace(sampling, n=1, temperature=0.0, top_p=1.0, top_k=-1))
        baselines = [c._replace(sample_index=sampling.n) for c in greedy.completions]
        baseline_traj = greedy.trajectories or []
    return _Sampled(main, baselines, baseline_traj, time.perf_counter() - t0)


def _commit(
    ctx: RunContext,
    stage: StageWriter,
    batch: pa.Table,
    sampled: _Sampled,
    where: _Where,
    policy_version: int,
) -> str:
    """Write ``rollouts.parquet`` (multi-turn rows carry their loss mask and turns), commit, log the
    metrics; returns the manifest URI. ``policy_version``: the weights the engine sampled from (synced
    per update)."""
    main, baselines, seconds = sampled.main, sampled.baselines, sampled.seconds
    completions = main.completions
    marks = [False] * len(completions) + [True] * len(baselines)
    trajectories = None if main.trajectories is None else main.trajectories + sampled.baseline_trajectories
    table = rollouts_table(
        completions + baselines,
        batch,
        where.iteration,
        policy_version,
        is_baseline=marks,
        trajectories=trajectories,
        group_offset=where.group_offset,
    )
    stage.write_table("rollouts.parquet", table, "rollouts")
    gen_tokens = sum(len(c.response_ids) for c in completions + baselines)
    summary = {
        "samples": len(completions),
        "baseline_samples": len(baselines),
        "epoch": where.epoch,
        "prompt_cursor": where.prompt_cursor,
        "generated_tokens": gen_tokens,
        "seconds": seconds,
        **main.metrics,  # multi-turn: turns, tool calls, tool-call rate (none for single-turn)
    }
    metrics = {
        "timing_s/rollout": seconds,
        "perf/gen_tokens_per_s": gen_tokens / max(seconds, 1e-9),
        "train/epoch": where.epoch,
        **main.metrics,
    }
    if where.gen_batch:  # logged once per step with the iteration's other generation batches
        summary[DEFERRED_METRICS] = metrics
    uri = stage.commit(summary=summary)
    if not where.gen_batch:
        ctx.tracker().log_metrics(metrics, step=where.iteration)
    return uri
