"""Held-out passes: the held-out prompts answered by a policy (greedy, or ``eval.k`` samples each),
scored by the run's reward scorers, and what validation and eval read of them (accuracy, pass@k).

Validation (every few RL iterations, on the RL loop's engine) and eval (once, on an exported policy)
make the same passes, so the last validation and the eval of one policy agree. A pass is named by the
folder of its tables in the stage (``""``: the stage's top, ``"sampled/"``...), and written there as
``rollouts.parquet`` and ``rewards.parquet``.

Generation runs on every rank of an SPMD job (each engine its share, every rank gets all the rollouts:
:func:`~stages.floor.rollouts.sharded_rollouts`); scoring and writing are the main rank's, inside the
stage's :func:`~stages.floor.commit.commit_once`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import pyarrow as pa

from stages.floor.artifacts import rollouts_table
from stages.floor.rollouts import Rollouts, sharded_rollouts
from stages.floor.scorers import score_batch
from verl_core.algorithms.evaluation import pass_at_k, per_prompt_correct
from verl_core.config import EvalConfig, MultiTurnConfig, RewardConfig, SandboxConfig
from verl_core.reward import RewardBatch, RewardResult, WeightedScorer, batch_from_columns, rewards_table
from verl_core.rollout import RolloutEngine, SamplingParams
from verl_core.store import StageWriter


class Generated(NamedTuple):
    """A pass generated: its rollouts and the seconds generation took."""

    rollouts: Rollouts
    seconds: float


class Scored(NamedTuple):
    """A pass scored: its rollouts table, the reward batch and its result, ``{group_id: (n, c)}``
    (samples and correct ones per prompt, sorted by group id)."""

    rollouts: pa.Table
    batch: RewardBatch
    result: RewardResult
    per_prompt: dict[int, tuple[int, int]]

    @property
    def accuracy(self) -> float:
        """Mean ``correct`` over the samples (the one accuracy rule: a rule scorer's verdict, or score
        ≥ ``reward.correct_threshold``, :func:`verl_core.reward.score_rollouts`)."""
        return sum(self.result.correct) / max(1, self.batch.size)

    def pass_at_k_each(self, k: int) -> list[float]:
        """The unbiased pass@k of each prompt's samples, in group id order."""
        return [pass_at_k(n, c, k) for n, c in self.per_prompt.values()]

    def pass_at(self, k: int) -> float:
        """pass@k: the mean over prompts of :meth:`pass_at_k_each`."""
        each = self.pass_at_k_each(k)
        return sum(each) / max(1, len(each))


def greedy_sampling(e: EvalConfig, max_new_tokens: int, stop: Sequence[str]) -> SamplingParams:
    """Eval's greedy pass: one response per prompt (accuracy)."""
    return SamplingParams(n=1, temperature=0.0, seed=e.seed, max_new_tokens=max_new_tokens, stop=tuple(stop))


def sampled_sampling(e: EvalConfig, max_new_tokens: int, stop: Sequence[str]) -> SamplingParams | None:
    """The sampled pass (pass@k): ``eval.k`` samples per prompt at ``eval.temperature``/``eval.top_p``,
    seeded by ``eval.seed`` alone, so every validation draws the same random numbers and the last one
    agrees with the eval of its policy; None when ``eval.k`` = 1 (no sampled pass)."""
    if e.k == 1:
        return None
    return SamplingParams(
        n=e.k, temperature=e.temperature, top_p=e.top_p, seed=e.seed,
        max_new_tokens=max_new_tokens, stop=tuple(stop),
    )  # fmt: skip


def generate_passes(
    engine: RolloutEngine,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    passes: dict[str, SamplingParams],
    multi_turn: MultiTurnConfig,
    max_response_length: int,
    sandbox: SandboxConfig,
) -> dict[str, Generated]:
    """Each pass of ``passes`` (folder → sampling) on the prompts, in order; every rank of an SPMD
    job makes the same calls and gets all the rollouts."""
    out = {}
    for folder, sampling in passes.items():
        t0 = time.perf_counter()
        rollouts = sharded_rollouts(
            engine, tokenizer, prompt_ids, sampling, multi_turn, max_response_length, sandbox
        )
        out[folder] = Generated(rollouts, time.perf_counter() - t0)
    return out


def score_passes(
    stage: StageWriter,
    prompts: pa.Table,
    generated: dict[str, Generated],
    scorers: list[WeightedScorer],
    *,
    reward: RewardConfig,
    sandbox: SandboxConfig,
    max_response_length: int,
    iteration: int,
    policy_version: int,
) -> dict[str, Scored]:
    """Score each generated pass with ``scorers`` (``reward.*``'s, already built) and write its
    ``{folder}rollouts.parquet`` and ``{folder}rewards.parquet`` into ``stage``, in order. ``prompts``:
    the held-out prompt rows the rollouts answer; ``iteration``/``policy_version``: their columns
    (-1 outside the RL loop)."""
    out = {}
    for folder, gen in generated.items():
        rollouts = rollouts_table(
            gen.rollouts.completions, prompts, iteration,
            policy_version=policy_version, trajectories=gen.rollouts.trajectories,
        )  # fmt: skip
        batch = batch_from_columns(rollouts)
        result = score_batch(reward, sandbox, batch, max_response_length, scorers)
        stage.write_table(f"{folder}rollouts.parquet", rollouts, "rollouts")
        stage.write_table(f"{folder}rewards.parquet", rewards_table(batch, result), "rewards")
        out[folder] = Scored(rollouts, batch, result, per_prompt_correct(batch.group_id, result.correct))
    return out
