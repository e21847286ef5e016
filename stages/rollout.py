"""Rollout stage: sample ``rollout.n`` responses per prompt of iteration i's batch with the current
policy; writes ``iter-XXXX/rollout/rollouts.parquet`` (kind "rollouts").

The batch of iteration i comes from a deterministic loader over ``prompt_tokens/train``: one seeded
permutation per epoch, batches taken in order across epoch boundaries, so the same iteration always
sees the same prompts (a resumed run included). Sampling is seeded by (rollout.seed, i).
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa
import torch
from prefect import task

from stages.rl_state import get_state
from verl_core.config import DataConfig, RolloutConfig
from verl_core.errors import DataError
from verl_core.rollout import Completion, SamplingParams
from verl_core.run import RunContext


def iteration_stage(iteration: int, name: str) -> str:
    return f"iter-{iteration:04d}/{name}"


def batch_rows(n: int, batch_size: int, iteration: int, *, seed: int, shuffle: bool) -> tuple[list[int], int]:
    """Rows of iteration ``iteration`` and the epoch its first row is in. Row k of the whole stream
    (k = iteration·B + j) is ``perm_e[k mod n]`` with e = k // n and perm_e a permutation seeded
    by (seed, e) (identity without shuffle)."""
    if n == 0:
        raise DataError("the prompt set is empty")
    rows, perms = [], {}
    first = iteration * batch_size
    for k in range(first, first + batch_size):
        epoch, pos = divmod(k, n)
        if epoch not in perms:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            perms[epoch] = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
        rows.append(perms[epoch][pos])
    return rows, first // n


def sampling_params(
    rollout: RolloutConfig, max_new_tokens: int, iteration: int, *, validation: bool
) -> SamplingParams:
    temperature = rollout.val_temperature if validation else rollout.temperature
    return SamplingParams(
        n=rollout.val_n if validation else rollout.n,
        temperature=temperature,
        top_p=1.0 if validation else rollout.top_p,
        top_k=-1 if validation else rollout.top_k,
        max_new_tokens=max_new_tokens,
        stop=tuple(rollout.stop),
        seed=rollout.seed * 1_000_003 + iteration + (500_000 if validation else 0),
    )


@task(name="rollout")
def rollout(
    ctx: RunContext,
    data: DataConfig,
    cfg: RolloutConfig,
    template_pack_uri: str,
    iteration: int,
    lineage: str,
) -> str:
    """Generate iteration ``iteration``'s rollouts with the in-memory policy (version = iteration)."""
    store = ctx.store()
    # 1. Skip when committed for this iteration of this policy lineage
    params = {
        "iteration": iteration,
        "lineage": lineage,
        "rollout": cfg.model_dump(mode="json"),
        "batch": data.train_batch_size,
        "max_response_length": data.max_response_length,
        "seed": data.seed,
        "shuffle": data.shuffle,
    }
    stage = store.open_stage(
        ctx.run_id,
        iteration_stage(iteration, "rollout"),
        params=params,
        inputs={"prompts": template_pack_uri},
    )
    if stage.done:
        return stage.manifest_uri
    state = get_state(ctx)
    if state.version != iteration:
        raise RuntimeError(
            f"rollout of iteration {iteration} needs policy version {iteration}, have {state.version}"
        )

    # 2. The iteration's prompts
    prompts = store.read_table(store.read_manifest(template_pack_uri), "prompt_tokens/train.parquet")
    rows, epoch = batch_rows(
        prompts.num_rows, data.train_batch_size, iteration, seed=data.seed, shuffle=data.shuffle
    )
    batch = prompts.take(rows)

    # 3. Generate
    t0 = time.perf_counter()
    completions = state.engine.generate(
        batch.column("input_ids").to_pylist(),
        sampling_params(cfg, data.max_response_length, iteration, validation=False),
    )
    seconds = time.perf_counter() - t0

    # 4. Write and commit
    table = rollouts_table(completions, batch, iteration, policy_version=state.version)
    stage.write_table("rollouts.parquet", table, "rollouts")
    gen_tokens = sum(len(c.response_ids) for c in completions)
    summary = {
        "samples": len(completions),
        "epoch": epoch,
        "generated_tokens": gen_tokens,
        "seconds": seconds,
    }
    uri = stage.commit(summary=summary)
    ctx.tracker().log_metrics(
        {
            "timing_s/rollout": seconds,
            "perf/gen_tokens_per_s": gen_tokens / max(seconds, 1e-9),
            "train/epoch": epoch,
        },
        step=iteration,
    )
    return uri


def rollouts_table(
    completions: list[Completion], prompts: pa.Table, iteration: int, policy_version: int
) -> pa.Table:
    """One row per completion (kind "rollouts"); ``prompts`` are the generate() input rows."""
    names = ("group_id", "sample_index", "prompt_index", "data_source", "ground_truth", "prompt_text")
    cols: dict[str, list[Any]] = {name: [] for name in names}
    index = prompts.column("index").to_pylist()
    source = prompts.column("data_source").to_pylist()
    truth = prompts.column("ground_truth").to_pylist()
    text = prompts.column("prompt_text").to_pylist()
    for c in completions:
        p = c.prompt_index
        cols["group_id"].append(p)
        cols["sample_index"].append(c.sample_index)
        cols["prompt_index"].append(index[p])
        cols["data_source"].append(source[p])
        cols["ground_truth"].append(truth[p])
        cols["prompt_text"].append(text[p])
    return pa.table(
        {
            "iteration": pa.array([iteration] * len(completions), pa.int64()),
            **cols,
            "prompt_ids": [c.prompt_ids for c in completions],
            "response_ids": [c.response_ids for c in completions],
            "response_text": [c.response_text for c in completions],
            "logprobs": [c.logprobs for c in completions],
            "finish_reason": [c.finish_reason for c in completions],
            "prompt_length": pa.array([len(c.prompt_ids) for c in completions], pa.int32()),
            "response_length": pa.array([len(c.response_ids) for c in completions], pa.int32()),
            "policy_version": pa.array([policy_version] * len(completions), pa.int64()),
        }
    )
