"""Scoring a batch of rollouts: weighted scorers, DAPO's overlong penalty, errors, metrics.

    score_i = sum_k w_k * s_k(i)  +  overlong_penalty_factor * p(len_i)

``components`` of a sample hold each term by name (the scorer's name, ``"overlong"`` for the
penalty), so they sum to its score. The RL loop calls :func:`score_rollouts` in-process; the reward
stage wraps it with the artifact store.

Errors (``on_error``): a scorer that failed on a sample (raised, timed out) either fails the whole
call with :class:`RewardError` naming the row (group_id / sample_index), the data_source and the
error (``"fail"``; :class:`ScorerCodeError` when the scorer says the error happens again on the same
input, :func:`verl_core.reward.functions.is_deterministic`: a retry cannot help), or contributes 0 for
that sample (``"zero"``), counted in ``reward/errors``.

Accuracy (``correct``) comes from the first ``rule`` scorer (give it weight 0 to measure accuracy
without rewarding it); without one, a sample is correct when its score is ≥ ``correct_threshold``,
``extracted`` is all None and the metrics have no ``reward/no_answer_frac``. Training, validation and
eval all use this one rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import pyarrow as pa

from verl_core.errors import DataError, VerlFlowError
from verl_core.reward.functions import is_deterministic
from verl_core.reward.scorers import RewardBatch, Scorer, ScorerOutput
from verl_core.runtime.watchdog import beat

OnError = Literal["fail", "zero"]
OVERLONG = "overlong"

_EXTRA_INFO_COLUMNS = (
    "iteration",
    "group_id",
    "sample_index",
    "prompt_index",
    "finish_reason",
    "response_length",
)


class RewardError(VerlFlowError):
    """A scorer failed on a sample under ``on_error="fail"``; the message names the row."""


class ScorerCodeError(RewardError):
    """A :class:`RewardError` that the same scoring raises again (the scorer's code failed on the row
    deterministically, e.g. a custom function's ``TypeError``): not worth a retry."""


class WeightedScorer(NamedTuple):
    """A scorer, its name in ``components`` and its weight in the total."""

    name: str
    weight: float
    scorer: Scorer


class RewardResult(NamedTuple):
    """Scores of B samples (row i = sample i of the batch).

    scores      (B,)  total score
    components  (B,)  name → weighted contribution (they sum to the score)
    extracted   (B,)  the rule scorer's extracted answer, None when none (or no rule scorer)
    correct     (B,)  the rule scorer's correctness (without one: score ≥ correct_threshold)
    errors      (B,)  None, or "scorer: error" for samples zeroed under on_error="zero"
    metrics     verl-style metric names → values (see :func:`reward_metrics`)
    """

    scores: list[float]
    components: list[dict[str, float]]
    extracted: list[str | None]
    correct: list[bool]
    errors: list[str | None]
    metrics: dict[str, float]


def overlong_penalty(
    response_lengths: Sequence[int], *, max_response_length: int, buffer_len: int
) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), with L_max = ``max_response_length``
    and L_cache = ``buffer_len``:

        p(len) = 0                                  len <= L_max - L_cache
               = ((L_max - L_cache) - len) / L_cache  L_max - L_cache < len <= L_max
               = -1                                 len > L_max
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"overlong buffer length {buffer_len} must be in 1..{max_response_length}")
    expected = max_response_length - buffer_len
    out = []
    for n in response_lengths:
        if n <= expected:
            out.append(0.0)
        elif n <= max_response_length:
            out.append((expected - n) / buffer_len)
        else:
            out.append(-1.0)
    return out


def score_rollouts(
    batch: RewardBatch,
    scorers: Sequence[WeightedScorer],
    *,
    on_error: OnError,
    max_response_length: int,
    overlong_buffer_len: int = 0,
    overlong_penalty_factor: float = 1.0,
    correct_threshold: float = 1.0,
) -> RewardResult:
    """Score ``batch`` with the weighted sum of ``scorers`` plus the overlong penalty
    (``overlong_buffer_len`` 0: none); see the module docstring.

    The accuracy rule (one for training, validation and eval): a sample is correct when the scorer
    that reports correctness (a rule scorer) says so; without such a scorer, when its total score is
    ≥ ``correct_threshold`` (1.0: partial credit does not count)."""
    n = batch.size
    scores = [0.0] * n
    components: list[dict[str, float]] = [{} for _ in range(n)]
    errors: list[str | None] = [None] * n
    rule: ScorerOutput | None = None
    scorer_metrics: dict[str, float] = {}
    for ws in scorers:
        out = ws.scorer(batch)
        scorer_metrics.update({f"reward/{ws.name}/{k}": v for k, v in (out.metrics or {}).items()})
        for i in range(n):
            error = out.errors[i]
            if error is not None:
                if on_error == "fail":
                    deterministic = out.kinds is not None and is_deterministic(out.kinds[i])
                    raise (ScorerCodeError if deterministic else RewardError)(
                        f"reward scorer {ws.name!r} failed on row {batch.row_name(i)} "
                        f"(data_source {batch.data_source[i]!r}): {error}"
                    )
                errors[i] = f"{ws.name}: {error}" if errors[i] is None else f"{errors[i]}; {ws.name}: {error}"
            value = 0.0 if error is not None else ws.weight * out.scores[i]
            components[i][ws.name] = value
            scores[i] += value
        if rule is None and out.extracted is not None:
            rule = out
        beat(scored_rows=n, scorer=ws.name)
    if overlong_buffer_len > 0:
        penalty = overlong_penalty(
            batch.response_length, max_response_length=max_response_length, buffer_len=overlong_buffer_len
        )
        for i, p in enumerate(penalty):
            components[i][OVERLONG] = overlong_penalty_factor * p
            scores[i] += overlong_penalty_factor * p
    extracted: list[str | None] = [None] * n
    correct = [score >= correct_threshold for score in scores]
    if rule is not None and rule.extracted is not None and rule.correct is not None:
        extracted, correct = list(rule.extracted), list(rule.correct)
    metrics = reward_metrics(
        scores, components, extracted if rule is not None else None, correct, errors, batch
    )
    if n:
        metrics.update(scorer_metrics)
    return RewardResult(scores, components, extracted, correct, errors, metrics)


def metrics_of_rows(batch: RewardBatch, result: RewardResult, rows: Sequence[int]) -> dict[str, float]:
    """:func:`reward_metrics` of ``rows`` only (e.g. the sampled responses, not ReMax's greedy
    baselines), plus the scorers' own counts of the whole call (HTTP requests, retries)."""

    def pick(xs: Sequence[Any]) -> list[Any]:
        return [xs[i] for i in rows]

    sub = RewardBatch(*(pick(column) for column in batch))
    has_rule = "reward/no_answer_frac" in result.metrics
    extracted = pick(result.extracted) if has_rule else None
    out = reward_metrics(
        pick(result.scores),
        pick(result.components),
        extracted,
        pick(result.correct),
        pick(result.errors),
        sub,
    )
    scorer_counts = {k: v for k, v in result.metrics.items() if k not in out}
    return {**out, **scorer_counts} if out else out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def reward_metrics(
    scores: Sequence[float],
    components: Sequence[Mapping[str, float]],
    extracted: Sequence[str | None] | None,
    correct: Sequence[bool],
    errors: Sequence[str | None],
    batch: RewardBatch,
) -> dict[str, float]:
    """verl-style metrics of one batch: ``critic/score/{mean,std,max,min}`` (std: population, ddof 0),
    ``reward/{name}/mean`` per component, ``reward/accuracy`` (mean ``correct``),
    ``reward/no_answer_frac`` (only with a rule scorer, ``extracted`` not None), ``reward/errors`` (zeroed
    samples), ``response_length/{mean,max,clip_ratio}`` (clip ratio: fraction with finish_reason
    "length"). Empty batch: {}."""
    n = len(scores)
    if n == 0:
        return {}
    mean = _mean(scores)
    m: dict[str, float] = {
        "critic/score/mean": mean,
        "critic/score/std": math.sqrt(_mean([(s - mean) ** 2 for s in scores])),
        "critic/score/max": max(scores),
        "critic/score/min": min(scores),
    }
    for name in components[0]:
        m[f"reward/{name}/mean"] = _mean([c[name] for c in components])
    m["reward/accuracy"] = _mean([float(c) for c in correct])
    if extracted is not None:
        m["reward/no_answer_frac"] = _mean([float(x is None) for x in extracted])
    m["reward/errors"] = float(sum(e is not None for e in errors))
    m["response_length/mean"] = _mean([float(x) for x in batch.response_length])
    m["response_length/max"] = float(max(batch.response_length))
    m["response_length/clip_ratio"] = _mean([float(f == "length") for f in batch.finish_reason])
    return m


# --------------------------------------------------------------------------------------------------
# Tables


def batch_from_columns(columns: pa.Table | Mapping[str, Sequence[Any]]) -> RewardBatch:
    """A :class:`RewardBatch` from a "rollouts" table (or a mapping with the same column names).

    A row's ``extra_info`` (what a custom function gets) is the dataset row's ``extra_info`` as verl
    passes it (the table's ``extra_info`` column, when it has one: its non-null keys) over the
    rollout's own columns (``_EXTRA_INFO_COLUMNS``, where the table has them): on a shared key the
    dataset's value wins. Raises DataError naming the missing columns."""
    names = set(columns.column_names if isinstance(columns, pa.Table) else columns)
    required = [f for f in RewardBatch._fields if f != "extra_info"]
    missing = [f for f in required if f not in names]
    if missing:
        raise DataError(f"reward: the rollouts lack column(s) {', '.join(missing)}")

    def col(name: str) -> list[Any]:
        if isinstance(columns, pa.Table):
            return columns.column(name).to_pylist()
        return list(columns[name])

    data = {f: col(f) for f in required}
    info = {k: col(k) for k in _EXTRA_INFO_COLUMNS if k in names}
    n = len(data["group_id"])
    rows: list[Any] = col("extra_info") if "extra_info" in names else [None] * n
    if any(len(v) != n for v in [*data.values(), *info.values(), rows]):
        raise DataError("reward: the rollout columns have different lengths")
    extra = [
        {k: v[i] for k, v in info.items()} | {k: v for k, v in (rows[i] or {}).items() if v is not None}
        for i in range(n)
    ]
    return RewardBatch(**data, extra_info=extra)


def rewards_table(batch: RewardBatch, result: RewardResult) -> pa.Table:
    """The "rewards" artifact table of ``result`` (row i scores row i of the batch)."""
    from verl_core.store.schemas import get_schema

    schema = get_schema("rewards")
    return pa.table(
        {
            "group_id": pa.array(batch.group_id, pa.int64()),
            "sample_index": pa.array(batch.sample_index, pa.int32()),
            "score": pa.array(result.scores, pa.float32()),
            "components": pa.array(
                [list(c.items()) for c in result.components], schema.field("components").type
            ),
            "extracted_answer": pa.array(result.extracted, pa.string()),
            "correct": pa.array(result.correct, pa.bool_()),
        },
        schema=schema,
    )
