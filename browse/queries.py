"""Queries of the rollout browser over a store's committed artifacts (read-only).

A :class:`Catalog` opens one store (a local path or ``s3://``) and answers everything the pages
show. It finds files only through committed manifests (:class:`verl_core.store.ArtifactStore`), so a
run still writing shows the stages it has committed and nothing half-written. Results are pandas
DataFrames.

Sample sets (``kind``, ``key``), as :meth:`Catalog.sample_sets` lists them:

    train   iter-0003            iter-0003/rollout + reward + update (dynamic sampling:
                                 iter-0003/gen-1 for generation batch 1, no update)
    val     iter-0003            iter-0003/val, greedy; iter-0003/sampled its sampled pass
    eval    export-iter-0002/greedy, export-iter-0002/sampled     eval/{label}

A sample's id is ``"{group_id}:{sample_index}"`` (unique within a set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pandas as pd

SampleKind = Literal["train", "val", "eval"]

# Columns of Catalog.samples / Catalog.group (one row per sample)
SAMPLE_COLUMNS = (
    "sample_id",  # "{group_id}:{sample_index}"
    "group_id",  # the prompt's position in the iteration's batch (its GRPO group)
    "sample_index",  # the sample's index in its group (ReMax's greedy baseline: rollout.n)
    "prompt_id",  # the prompt row's index in its prompt set (the same prompt across iterations)
    "data_source",
    "prompt",  # the user's text, without the chat template
    "response",
    "reward",  # the reward stage's score
    "correct",
    "advantage",  # mean over the response tokens (null: no update stage, e.g. val/eval)
    "response_length",
    "truncated",  # finish_reason == "length"
    "tool_calls",  # number of tool calls (multi-turn), 0 otherwise
    "policy_version",
    "extracted_answer",
    "ground_truth",
    "garbled",
    "garbled_reason",  # "" when not garbled (browse.garbled)
    "is_baseline",
    "finish_reason",
)
# Columns of Catalog.tokens (one row per response token)
TOKEN_COLUMNS = (
    "position",
    "token_id",
    "token",  # the token's text (the run's tokenizer)
    "advantage",  # null without an update stage
    "kl",  # null when the update stored no KL (no KL in the reward)
    "behaviour_logprob",  # the rollout engine's
    "trainer_logprob",  # the trainer's recomputed pi_old (null when the update did not store it)
    "mismatch",  # behaviour_logprob - trainer_logprob
    "model_token",  # False on tool-output tokens (multi-turn)
)


@dataclass(frozen=True)
class SampleFilter:
    """Filters of :meth:`Catalog.samples`; None: no filter on that column. ``text``: a
    case-insensitive substring of the prompt or the response (matched literally)."""

    data_source: str | None = None
    correct: bool | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    length_min: int | None = None
    length_max: int | None = None
    truncated: bool | None = None
    has_tool_calls: bool | None = None
    policy_version: int | None = None
    text: str | None = None
    garbled: bool | None = None


class Catalog:
    """The runs of one store, read-only. ``run_ids``: only these runs (None: all of the store's)."""

    def __init__(self, store_url: str, run_ids: list[str] | None = None) -> None:
        raise NotImplementedError

    def runs(self) -> pd.DataFrame:
        """One row per run: run_id, experiment, status ("finished": report committed, else
        "running or stopped"), stages, config_hash, created, updated, parent, link_kind
        ("run" | "fork" | "replay"), parent_iteration, iterations, reward_mean, accuracy,
        val_accuracy (the last of each), mlflow_run_url, prefect_flow_run_url (None when unknown)."""
        raise NotImplementedError

    def run_config(self, run_id: str) -> dict[str, Any]:
        """The run's resolved config, flattened (``{"actor.lr": "6e-05", ...}``) with secrets
        redacted as the trackers log it (:func:`verl_core.config.loader.flatten_config`)."""
        raise NotImplementedError

    def iterations(self, run_id: str) -> pd.DataFrame:
        """One row per iteration: iteration, reward_mean, accuracy, kl, response_length_mean,
        clip_frac, truncated_frac, val_accuracy (NaN where the run has none), then every other
        per-iteration metric of the committed stages under its logged name."""
        raise NotImplementedError

    def sample_sets(self, run_id: str) -> pd.DataFrame:
        """The run's committed sample sets: kind, key, iteration (-1 for eval), stage, rows, uri
        (the rollouts file)."""
        raise NotImplementedError

    def samples(
        self,
        run_id: str,
        kind: SampleKind,
        key: str,
        filters: SampleFilter | None = None,
        sort: list[tuple[str, bool]] | None = None,
        offset: int = 0,
        limit: int = 100,
    ) -> tuple[pd.DataFrame, int]:
        """A page of the set's samples matching ``filters`` (:data:`SAMPLE_COLUMNS`), sorted by
        ``sort`` ((column, ascending) pairs; then by group_id, sample_index), and the number of
        matching samples."""
        raise NotImplementedError

    def group(self, run_id: str, kind: SampleKind, key: str, prompt_id: int) -> pd.DataFrame:
        """The samples of prompt ``prompt_id`` in the set (its group: the n responses), by
        sample_index (:data:`SAMPLE_COLUMNS`)."""
        raise NotImplementedError

    def prompt_history(self, run_id: str, prompt: int | str) -> pd.DataFrame:
        """The training samples of one prompt across the run's iterations: ``prompt`` is a prompt
        id (the train set's) or a text contained in the prompt. Columns: iteration, then
        :data:`SAMPLE_COLUMNS`; ordered by iteration, sample_index."""
        raise NotImplementedError

    def tokens(self, run_id: str, kind: SampleKind, key: str, sample_id: str) -> pd.DataFrame:
        """Per response token of one sample (:data:`TOKEN_COLUMNS`)."""
        raise NotImplementedError

    def top_mismatch(self, run_id: str, kind: SampleKind, key: str, limit: int = 20) -> pd.DataFrame:
        """The samples whose behaviour and trainer log-probs differ most: sample_id, prompt_id,
        reward, response_length, max_abs_mismatch, mean_abs_mismatch, argmax_position; empty when
        the set has no trainer log-probs."""
        raise NotImplementedError

    def rescores(self, run_id: str) -> list[str]:
        """Names of the run's rescores with a committed report."""
        raise NotImplementedError

    def rescore(self, run_id: str, name: str) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``(agreement, disagreements)`` of rescore ``name``: its ``comparison.parquet`` (one row
        per rescored table: source, split, iteration, rows, score/accuracy old and new, agreement,
        tt/tf/ft/ff) with a last row ``source == "all"``, and its ``disagreements.parquet`` (both
        verdicts: score_old/new, correct_old/new, extracted_old/new) with a sample_id column."""
        raise NotImplementedError
