"""The gate's paired statistics: exact McNemar, the paired bootstrap interval, Wilson intervals and
the verdict rules, against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from verl_core.algorithms.paired import (
    Interval,
    decide,
    discordant_pairs,
    mcnemar_exact,
    paired_bootstrap_ci,
    wilson_interval,
)


def test_mcnemar_exact_by_hand() -> None:
    # b=1, c=9: n=10, p = 2·(C(10,0) + C(10,1)) / 2^10 = 2·11/1024 = 22/1024 ≈ 0.02148
    assert mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)  # two-sided: symmetric
    # b=0, c=3: p = 2·C(3,0)/2^3 = 2/8
    assert mcnemar_exact(0, 3) == pytest.approx(0.25)
    # b=c=5: 2·(1+10+45+120+210+252)/1024 = 1276/1024 > 1 → capped at 1
    assert mcnemar_exact(5, 5) == 1.0
    assert mcnemar_exact(0, 0) == 1.0  # no discordant pair: no evidence either way
    with pytest.raises(ValueError, match="b=-1"):
        mcnemar_exact(-1, 2)


def test_mcnemar_exact_matches_scipy_binomtest() -> None:
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(1, 9), (3, 7), (12, 30), (50, 61), (0, 17)]:
        assert mcnemar_exact(b, c) == pytest.approx(stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-9)


def test_wilson_interval_by_hand() -> None:
    # 8/10 at 95%: z = 1.95996, z² = 3.84146, denom = 1 + z²/10 = 1.384146,
    # centre = (0.8 + z²/20) / denom = 0.99207/1.384146 = 0.71674,
    # half = z/denom · sqrt(0.8·0.2/10 + z²/400) = 1.41601 · sqrt(0.0256037) = 0.22658
    ci = wilson_interval(8, 10, 0.95)
    assert ci.low == pytest.approx(0.71674 - 0.22658, abs=1e-4)
    assert ci.high == pytest.approx(0.71674 + 0.22658, abs=1e-4)
    # 0/10 keeps a positive upper end (z²/N / (1 + z²/N) = 0.38415/1.38415 = 0.2775), never [0, 0]
    zero = wilson_interval(0, 10, 0.95)
    assert zero.low == pytest.approx(0.0, abs=1e-12) and zero.high == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(3, 4, 0.0) == Interval(0.75, 0.75)  # confidence 0: the point itself


def test_discordant_pairs() -> None:
    champion = [True, True, False, False, True]
    challenger = [True, False, True, True, False]
    # prompt 1, 4: champion alone right (b=2); prompts 2, 3: challenger alone (c=2)
    assert discordant_pairs(champion, challenger) == (2, 2)


def test_paired_bootstrap_ci_brackets_the_difference_and_shrinks_with_n() -> None:
    # b=2, c=10 of N=40: d = (10 - 2)/40 = 0.2; the table ×10 (b=20, c=100, N=400) has the same d and
    # a standard error √10 ≈ 3.2× smaller, so a narrower interval
    small = paired_bootstrap_ci(2, 10, 40, confidence=0.95, n_resamples=4000, seed=0)
    large = paired_bootstrap_ci(20, 100, 400, confidence=0.95, n_resamples=4000, seed=0)
    for ci in (small, large):
        assert ci.low < 0.2 < ci.high
    assert (large.high - large.low) < 0.5 * (small.high - small.low)
    # the sd of d is sqrt((b + c)/N - d²)/sqrt(N) = sqrt(0.3 - 0.04)/sqrt(40) = 0.0806; a 95% interval is
    # about ±1.96·0.0806 = ±0.158 wide around 0.2
    assert small.high - small.low == pytest.approx(2 * 1.96 * math.sqrt(0.26 / 40), rel=0.15)
    # seeded: the same interval again
    assert paired_bootstrap_ci(2, 10, 40, confidence=0.95, n_resamples=4000, seed=0) == small
    # no discordant pair: every resample differs by 0
    assert paired_bootstrap_ci(0, 0, 10, confidence=0.95, n_resamples=100, seed=1) == Interval(0.0, 0.0)


RULES = {"confidence": 0.95, "min_improvement": 0.0, "max_regression": 0.05, "min_accuracy": 0.5}


def test_decide_first_model_against_the_floor() -> None:
    ok = decide([True, True, False, True], None, ["a"] * 4, n_resamples=100, seed=0, **RULES)
    assert ok.verdict == "pass" and ok.champion is None and ok.p_value is None
    assert [g.name for g in ok.guards] == ["floor"]
    assert ok.challenger.accuracy == 0.75  # 3/4 ≥ gate.min_accuracy 0.5
    low = decide([True, False, False, False], None, ["a"] * 4, n_resamples=100, seed=0, **RULES)
    assert low.verdict == "reject" and "gate.min_accuracy" in low.line()


def test_decide_passes_a_significantly_better_challenger() -> None:
    # 30 prompts: both right on 10, champion alone on 1, challenger alone on 9 (p = 22/1024 < 0.05)
    champion = [True] * 10 + [True] + [False] * 9 + [False] * 10
    challenger = [True] * 10 + [False] + [True] * 9 + [False] * 10
    d = decide(challenger, champion, ["a"] * 30, n_resamples=2000, seed=0, **RULES)
    assert d.verdict == "pass", d.line()
    assert d.discordant == (1, 9) and d.p_value == pytest.approx(22 / 1024)
    assert d.difference == pytest.approx(8 / 30)
    assert d.difference_ci is not None and d.difference_ci.low > 0
    assert d.to_dict()["guards"][0]["name"] == "significance"


def test_decide_rejects_a_tie_and_a_source_regression() -> None:
    same = [True, False] * 10
    tie = decide(same, same, ["a"] * 20, n_resamples=200, seed=0, **RULES)
    assert tie.verdict == "reject" and tie.p_value == 1.0
    assert "significance failed" in tie.line()
    # overall better (c=12, b=2) but source "b" drops by 2/4 = 0.5 > gate.max_regression 0.05
    champion = [False] * 12 + [True, True, False, False] + [True] * 4
    challenger = [True] * 12 + [False, False, False, False] + [True] * 4
    sources = ["a"] * 12 + ["b"] * 4 + ["a"] * 4
    d = decide(challenger, champion, sources, n_resamples=2000, seed=0, **RULES)
    by = {g.name: g for g in d.guards}
    assert by["significance"].ok and by["improvement"].ok and by["regression:a"].ok
    assert not by["regression:b"].ok and by["regression:b"].value == pytest.approx(-0.5)
    assert d.verdict == "reject" and "regression:b failed" in d.line()
