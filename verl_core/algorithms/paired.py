"""Paired comparison of two policies on the same prompts: the champion/challenger gate's statistics.

Each prompt ``i`` of the held-out set has a greedy correctness for both policies, ``a_i`` (champion)
and ``x_i`` (challenger), in {0, 1}. The 2×2 table of pairs::

                      challenger right   challenger wrong
    champion right          n11               b
    champion wrong           c               n00

Only the discordant pairs ``b`` (the champion alone is right) and ``c`` (the challenger alone is
right) carry information about which policy is better; the accuracy difference is
``d = acc(x) - acc(a) = (c - b) / N``.

- Exact McNemar test (McNemar 1947; the exact form is a sign test): under H0 "both policies are
  equally good", given ``n = b + c`` discordant pairs, ``b ~ Binomial(n, 1/2)``; the two-sided p-value
  is ``p = min(1, 2 · Σ_{k ≤ min(b, c)} C(n, k) / 2^n)`` (p = 1 when n = 0).
- Paired bootstrap CI of ``d`` (Efron & Tibshirani 1993, ch. 13, percentile interval): resample the N
  prompts with replacement, both policies' answers of a prompt together. A resample's difference only
  depends on how many of its prompts are of kind ``c`` and of kind ``b``, so drawing those counts
  ``(B*, C*, rest) ~ Multinomial(N, (b/N, c/N, 1 - (b+c)/N))`` is the same bootstrap without the
  ``(R, N)`` index matrix: ``d* = (C* - B*) / N``.
- Wilson score interval of one accuracy (Wilson 1927), ``p̂ = k/N``, ``z = Φ⁻¹(1 - α/2)``::

      centre = (p̂ + z²/2N) / (1 + z²/N),   half = z / (1 + z²/N) · sqrt(p̂(1-p̂)/N + z²/4N²)

:func:`decide` applies the gate's rules to these numbers and returns a :class:`GateDecision` holding
every figure and every guard, passed or not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from math import comb, sqrt
from statistics import NormalDist
from typing import Any, Literal

import numpy as np

Verdict = Literal["pass", "reject"]


@dataclass(frozen=True)
class Interval:
    """A two-sided confidence interval ``[low, high]``."""

    low: float
    high: float


@dataclass(frozen=True)
class Accuracy:
    """One policy's greedy accuracy over ``prompts`` prompts with its Wilson interval."""

    prompts: int
    correct: int
    accuracy: float
    ci: Interval


@dataclass(frozen=True)
class Guard:
    """One rule of the gate: its ``name``, the ``value`` it checked against ``threshold`` as ``rule``
    says, and whether it held."""

    name: str
    ok: bool
    value: float
    threshold: float
    rule: str


@dataclass(frozen=True)
class SourceComparison:
    """Accuracies of one data source: the challenger's, the champion's (None: no champion) and the
    difference (challenger - champion)."""

    source: str
    prompts: int
    challenger: float
    champion: float | None
    difference: float | None


@dataclass(frozen=True)
class GateDecision:
    """The gate's verdict and every number it rests on. ``discordant`` = ``(b, c)``: prompts only the
    champion got right, only the challenger got right; champion fields are None without a champion."""

    verdict: Verdict
    reasons: tuple[str, ...]
    confidence: float
    challenger: Accuracy
    champion: Accuracy | None
    difference: float | None
    difference_ci: Interval | None
    p_value: float | None
    discordant: tuple[int, int] | None
    by_source: tuple[SourceComparison, ...]
    guards: tuple[Guard, ...]

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def line(self) -> str:
        """The decision in one line (the CLI's exit line, the flow run's failure message)."""
        return f"gate: {self.verdict}: " + "; ".join(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``decision.json``)."""
        return dataclasses.asdict(self)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of ``b`` and ``c`` discordant pairs:
    ``min(1, 2 · Σ_{k ≤ min(b, c)} C(b + c, k) / 2^(b + c))``; 1.0 when ``b + c = 0``."""
    if b < 0 or c < 0:
        raise ValueError(f"mcnemar_exact: discordant counts must be >= 0, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(comb(n, k) for k in range(min(b, c) + 1))  # exact integers; one division at the end
    return min(1.0, 2 * tail / 2**n)


def _z(confidence: float) -> float:
    """``Φ⁻¹(1 - α/2)`` with ``α = 1 - confidence`` (0 at confidence 0)."""
    if not 0.0 <= confidence < 1.0:
        raise ValueError(f"confidence must be in [0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(correct: int, n: int, confidence: float) -> Interval:
    """Wilson score interval of the proportion ``correct / n`` (formula in the module docstring);
    ``[0, 1]`` when ``n = 0``."""
    if not 0 <= correct <= n:
        raise ValueError(f"wilson_interval: need 0 <= correct <= n, got correct={correct}, n={n}")
    if n == 0:
        return Interval(0.0, 1.0)
    z = _z(confidence)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return Interval(max(0.0, centre - half), min(1.0, centre + half))


def discordant_pairs(champion: Sequence[bool], challenger: Sequence[bool]) -> tuple[int, int]:
    """``(b, c)``: prompts only the champion got right, only the challenger got right (equal lengths)."""
    if len(champion) != len(challenger):
        raise ValueError(f"discordant_pairs: {len(champion)} champion answers for {len(challenger)} prompts")
    b = sum(1 for a, x in zip(champion, challenger, strict=True) if a and not x)
    c = sum(1 for a, x in zip(champion, challenger, strict=True) if x and not a)
    return b, c


def paired_bootstrap_ci(
    b: int, c: int, n: int, *, confidence: float, n_resamples: int, seed: int
) -> Interval:
    """Percentile bootstrap interval of ``d = (c - b) / n`` over ``n`` paired prompts, ``n_resamples``
    resamples drawn from ``np.random.default_rng(seed)`` (the multinomial form of the module
    docstring); ``[0, 0]`` when ``n = 0``."""
    if not 0 <= b + c <= n:
        raise ValueError(f"paired_bootstrap_ci: need b + c <= n, got b={b}, c={c}, n={n}")
    if n_resamples < 1:
        raise ValueError(f"paired_bootstrap_ci: n_resamples must be >= 1, got {n_resamples}")
    _z(confidence)  # checks the range
    if n == 0:
        return Interval(0.0, 0.0)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, [b / n, c / n, 1.0 - (b + c) / n], size=n_resamples)  # (R, 3)
    d = (counts[:, 1] - counts[:, 0]) / n  # (R,) resampled differences
    alpha = 1.0 - confidence
    low, high = np.quantile(d, [alpha / 2, 1.0 - alpha / 2])
    return Interval(float(low), float(high))


def accuracy(correct: Sequence[bool], confidence: float) -> Accuracy:
    """Mean of ``correct`` (one flag per prompt) with its Wilson interval."""
    k, n = sum(bool(x) for x in correct), len(correct)
    return Accuracy(prompts=n, correct=k, accuracy=k / n if n else 0.0, ci=wilson_interval(k, n, confidence))


def _by_source(
    sources: Sequence[str], challenger: Sequence[bool], champion: Sequence[bool] | None
) -> tuple[SourceComparison, ...]:
    out = []
    for s in sorted(set(sources)):
        rows = [i for i, src in enumerate(sources) if src == s]
        x = sum(bool(challenger[i]) for i in rows) / len(rows)
        a = None if champion is None else sum(bool(champion[i]) for i in rows) / len(rows)
        out.append(SourceComparison(s, len(rows), x, a, None if a is None else x - a))
    return tuple(out)


def decide(
    challenger: Sequence[bool],
    champion: Sequence[bool] | None,
    sources: Sequence[str],
    *,
    confidence: float,
    min_improvement: float,
    max_regression: float,
    min_accuracy: float,
    n_resamples: int,
    seed: int,
) -> GateDecision:
    """The gate's verdict on per-prompt greedy correctness (index i: the same prompt in every
    sequence; ``sources``: each prompt's data source). Pass when every guard holds:

    - no champion: ``floor``: challenger accuracy ≥ ``min_accuracy``;
    - with a champion: ``significance``: McNemar p < 1 - ``confidence`` and c > b (the challenger is
      better, not only different); ``improvement``: the low end of the ``confidence`` bootstrap
      interval of the difference ≥ ``min_improvement``; ``regression:<source>``, per data source:
      challenger - champion ≥ -``max_regression``.

    At ``confidence`` 0 the point estimates decide (p < 1, interval = the bootstrap median)."""
    if len(sources) != len(challenger) or (champion is not None and len(champion) != len(challenger)):
        n_champ = None if champion is None else len(champion)
        raise ValueError(
            f"decide: {len(challenger)} challenger answers, {n_champ} champion answers, "
            f"{len(sources)} sources"
        )
    alpha = 1.0 - confidence
    chal = accuracy(challenger, confidence)
    by_source = _by_source(sources, challenger, champion)
    if champion is None:
        floor = Guard(
            "floor", chal.accuracy >= min_accuracy, chal.accuracy, min_accuracy, "accuracy >= threshold"
        )
        cmp = ">=" if floor.ok else "<"
        why = f"first model: accuracy {chal.accuracy:.3f} {cmp} gate.min_accuracy {min_accuracy}"
        verdict: Verdict = "pass" if floor.ok else "reject"
        return GateDecision(
            verdict, (why,), confidence, chal, None, None, None, None, None, by_source, (floor,)
        )

    champ = accuracy(champion, confidence)
    b, c = discordant_pairs(champion, challenger)
    n = len(challenger)
    p = mcnemar_exact(b, c)
    diff = (c - b) / n if n else 0.0
    ci = paired_bootstrap_ci(b, c, n, confidence=confidence, n_resamples=n_resamples, seed=seed)
    guards = [
        Guard("significance", p < alpha and c > b, p, alpha, "p_value < threshold and challenger better"),
        Guard(
            "improvement",
            ci.low >= min_improvement,
            ci.low,
            min_improvement,
            "difference CI low >= threshold",
        ),
    ]
    for s in by_source:
        assert s.difference is not None
        guards.append(
            Guard(f"regression:{s.source}", s.difference >= -max_regression, s.difference, -max_regression,
                  "source difference >= threshold")
        )  # fmt: skip
    failed = [g for g in guards if not g.ok]
    summary = (
        f"accuracy {champ.accuracy:.3f} → {chal.accuracy:.3f}, difference {diff:+.3f} "
        f"[{ci.low:+.3f}, {ci.high:+.3f}], p={p:.3g} (b={b}, c={c})"
    )
    reasons = [summary]
    reasons += [f"{g.name} failed ({g.value:.3g} vs {g.threshold:.3g}: {g.rule})" for g in failed]
    verdict = "reject" if failed else "pass"
    return GateDecision(
        verdict, tuple(reasons), confidence, chal, champ, diff, ci, p, (b, c), by_source, tuple(guards)
    )
