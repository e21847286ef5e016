"""The three kinds of scorer behind ``reward.scorers``, each a callable ``(RewardBatch) -> ScorerOutput``.

* :class:`RuleScorer` - the data_source rules of :mod:`verl_core.reward.rules`; batches of at least
  ``parallel_min_samples`` are split into chunks scored by a pool of ``num_workers`` forked processes
  (the rules are pure module-level functions), smaller ones are scored in-process.
* :class:`FunctionScorer` - a custom ``module:function`` (or ``file.py:function``) run with a timeout
  in the form its signature asks for (:mod:`verl_core.reward.functions`).
* ``ModelScorer`` - a sequence-classification reward model (:mod:`verl_core.reward.model`).
* ``RemoteScorer`` / ``JudgeScorer`` - an HTTP batch-scoring endpoint / an LLM judge on an
  OpenAI-compatible endpoint (:mod:`verl_core.reward.remote`).
* :class:`CodeScorer` - the response's code run against the row's tests in the sandbox
  (:mod:`verl_core.reward.code`), ``num_workers`` sandboxes at once.

A scorer never raises for one bad sample: it returns the sample's error in ``errors`` (and, where it
knows, the error's kind in ``kinds``) and lets :func:`verl_core.reward.scoring.score_rollouts` apply
``on_error``. A sample that failed on its own
(its code crashed or timed out) is not an error of the scorer: it is scored as it did and counted in
the scorer's ``metrics`` (``reward/code/failures``).
"""

from __future__ import annotations

import math
import multiprocessing as mp
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, Protocol

from verl_core.errors import ConfigError, DataError
from verl_core.registry import UnknownNameError
from verl_core.reward.call_forms import CallForm, FunctionMode, call_form, function_name
from verl_core.reward.code import CodeScore, code_score, parse_tests, run_tests
from verl_core.reward.functions import ErrorKind, FunctionInputs, run_reward_function
from verl_core.reward.rules import RuleOptions, get_rule_scorer
from verl_core.runtime.sandbox import SandboxSpec


class RewardBatch(NamedTuple):
    """B samples to score: columns of the rollouts table (row i = sample i), all lists of length B.

    ``extra_info`` is what custom functions get as ``extra_info``: the dataset row's ``extra_info`` (as
    verl passes it: split, index, answer, question) and the rollout's iteration, group_id,
    sample_index, prompt_index, finish_reason and response_length where the table has them
    (:func:`verl_core.reward.scoring.batch_from_columns`)."""

    group_id: list[int]
    sample_index: list[int]
    data_source: list[str]
    ground_truth: list[str]
    prompt_text: list[str]
    response_text: list[str]
    response_length: list[int]
    finish_reason: list[str]
    extra_info: list[dict[str, Any]]

    @property
    def size(self) -> int:
        return len(self.group_id)

    def row_name(self, i: int) -> str:
        return f"group_id={self.group_id[i]}, sample_index={self.sample_index[i]}"


class ScorerOutput(NamedTuple):
    """One scorer's verdict on a batch: ``scores (B,)`` (unweighted; 0.0 where ``errors[i]`` is set),
    ``errors (B,)`` None or what went wrong; rule scorers also give ``extracted (B,)`` (None: no answer)
    and ``correct (B,)``; ``metrics``: the scorer's own counts (e.g. HTTP retries, the code scorer's
    ``failures``), reported as ``reward/{scorer name}/{key}``; ``kinds (B,)``: each error's kind
    (:data:`verl_core.reward.functions.ErrorKind`; None: not known, treated as transient)."""

    scores: list[float]
    errors: list[str | None]
    extracted: list[str | None] | None = None
    correct: list[bool] | None = None
    metrics: dict[str, float] | None = None
    kinds: list[ErrorKind | None] | None = None


class Scorer(Protocol):
    def __call__(self, batch: RewardBatch) -> ScorerOutput: ...


# --------------------------------------------------------------------------------------------------
# Rules

_RuleRow = tuple[float, str | None, bool, str | None]  # score, extracted, correct, error


def _rule_chunk(
    responses: Sequence[str], truths: Sequence[str], sources: Sequence[str], options: RuleOptions
) -> list[_RuleRow]:
    """Score one chunk in-process (also the task a pool worker runs)."""
    out: list[_RuleRow] = []
    for response, truth, source in zip(responses, truths, sources, strict=True):
        try:
            r = get_rule_scorer(source)(response, truth, options)
            out.append((float(r.score), r.extracted, bool(r.correct), None))
        except Exception as e:
            out.append((0.0, None, False, f"{type(e).__name__}: {e}"))
    return out


def score_rules(
    responses: Sequence[str],
    ground_truths: Sequence[str],
    data_sources: Sequence[str],
    options: RuleOptions,
    *,
    num_workers: int,
    parallel_min_samples: int,
) -> ScorerOutput:
    """Rule-score B responses; in a process pool when ``num_workers > 1`` and B >= ``parallel_min_samples``.

    Raises DataError when a data_source has no rule scorer (the message lists the known ones)."""
    for source in sorted(set(data_sources)):
        try:
            get_rule_scorer(source)
        except UnknownNameError as e:
            raise DataError(f"rule reward: {e} (use a function or model scorer for other data)") from None
    n = len(responses)
    if num_workers <= 1 or n < parallel_min_samples:
        rows = _rule_chunk(responses, ground_truths, data_sources, options)
    else:
        size = math.ceil(n / (4 * num_workers))  # a few chunks per worker evens out the load
        with ProcessPoolExecutor(num_workers, mp_context=mp.get_context("fork")) as pool:
            futures = [
                pool.submit(
                    _rule_chunk,
                    responses[a : a + size],
                    ground_truths[a : a + size],
                    data_sources[a : a + size],
                    options,
                )
                for a in range(0, n, size)
            ]
            rows = [row for f in futures for row in f.result()]
    scores, extracted, correct, errors = (list(c) for c in zip(*rows, strict=True)) if rows else ([],) * 4
    return ScorerOutput(scores, errors, extracted, correct)


class RuleScorer(NamedTuple):
    """Rule scoring with ``options``; see :func:`score_rules` for the process pool."""

    options: RuleOptions
    num_workers: int
    parallel_min_samples: int

    def __call__(self, batch: RewardBatch) -> ScorerOutput:
        return score_rules(
            batch.response_text,
            batch.ground_truth,
            batch.data_source,
            self.options,
            num_workers=self.num_workers,
            parallel_min_samples=self.parallel_min_samples,
        )


# --------------------------------------------------------------------------------------------------
# Custom functions


@dataclass(frozen=True)
class FunctionScorer:
    """A custom reward function (loaded with ``load_reward_function``) in ``mode`` with a timeout,
    every call also given the keyword arguments ``kwargs`` (``reward.function_kwargs``, verl's
    ``custom_reward_function.reward_kwargs``: bound as ``functools.partial(fn, **kwargs)``, as verl
    does). Its signature, with ``kwargs`` bound, is inspected once, here (``form``; a ConfigError when
    it fits no form of ``mode``, or when a keyword of ``kwargs`` is one the scorer passes itself).

    ``metrics``: ``extra/{key}``, the batch mean of each numeric extra key of dict returns (over the
    samples that returned it)."""

    fn: Callable[..., Any]
    mode: FunctionMode
    timeout_s: float
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    form: CallForm = field(init=False)
    bound: Callable[..., Any] = field(init=False)

    def __post_init__(self) -> None:
        bound = partial(self.fn, **self.kwargs) if self.kwargs else self.fn
        form = call_form(bound, self.mode)
        clash = sorted(set(self.kwargs) & set(form.keywords.values()))
        if clash:
            raise ConfigError(
                f"reward.function_kwargs: {', '.join(clash)} are passed by the scorer itself to "
                f"{function_name(self.fn)} (one value per sample)"
            )
        object.__setattr__(self, "bound", bound)
        object.__setattr__(self, "form", form)

    def __call__(self, batch: RewardBatch) -> ScorerOutput:
        inputs = FunctionInputs(
            list(batch.response_text), list(batch.ground_truth), list(batch.data_source), batch.extra_info
        )
        out = run_reward_function(
            self.bound, inputs, mode=self.mode, timeout_s=self.timeout_s, form=self.form
        )
        sums: dict[str, list[float]] = {}
        for extras in out.extras:
            for k, v in extras.items():
                sums.setdefault(k, []).append(v)
        metrics = {f"extra/{k}": sum(v) / len(v) for k, v in sums.items()}
        return ScorerOutput(out.scores, out.errors, metrics=metrics or None, kinds=out.kinds)


# --------------------------------------------------------------------------------------------------
# Code execution


class CodeScorer(NamedTuple):
    """The response's code against the row's tests (``ground_truth``) in the sandbox ``spec``, scored as
    ``mode`` (pass fraction or all-pass), ``num_workers`` runs at once (threads: each waits on its
    sandbox process). Tests that do not parse are the sample's error; the code's crash, timeout or
    limit hit is its failure, scored by the tests that passed before it and counted in ``metrics``
    (``failures``, of them ``timeouts``)."""

    spec: SandboxSpec
    mode: CodeScore
    num_workers: int

    def _one(self, response: str, tests_source: str) -> tuple[float, str | None, str | None]:
        try:
            tests = parse_tests(tests_source)
        except ValueError as e:
            return 0.0, str(e), None
        run = run_tests(response, tests, self.spec)
        if run.failure is not None and run.failure.startswith("sandbox failed"):
            return 0.0, run.failure, None
        return code_score(run, self.mode), None, run.failure

    def __call__(self, batch: RewardBatch) -> ScorerOutput:
        with ThreadPoolExecutor(max(self.num_workers, 1)) as pool:
            rows = list(pool.map(self._one, batch.response_text, batch.ground_truth))
        scores, errors, failures = (list(c) for c in zip(*rows, strict=True)) if rows else ([], [], [])
        metrics = {
            "failures": float(sum(f is not None for f in failures)),  # crashed, timed out, hit a limit
            "timeouts": float(sum(f == "timeout" for f in failures)),
        }
        return ScorerOutput(scores, errors, metrics=metrics)
