"""Rule scorers: verl's GSM8K behaviour on hand-picked responses, arithmetic, \\boxed{} math, the pool."""

from __future__ import annotations

import pytest

from verl_core.errors import DataError
from verl_core.reward import (
    RuleOptions,
    arithmetic_score,
    boxed_math_score,
    extract_gsm8k,
    get_rule_scorer,
    gsm8k_score,
    last_boxed,
    score_rules,
)

# score 1.0 when right, 0.1 when an answer is there but wrong (so it differs from "no answer": 0)
STRICT = RuleOptions("strict", 1.0, 0.1)
FLEXIBLE = RuleOptions("flexible", 1.0, 0.1)
X300 = "x" * 300

# (response, ground truth, strict: (extracted, score), flexible: (extracted, score))
GSM8K_CASES = [
    # plain '#### N': both find 72
    ("48 + 24 = 72 clips.\n#### 72", "72", ("72", 1.0), ("72", 1.0)),
    # no '####': strict silently scores 0; flexible reads the last number, trailing '.' kept (wrong)
    ("The answer is 72.", "72", (None, 0.0), ("72.", 0.1)),
    ("The answer is 72", "72", (None, 0.0), ("72", 1.0)),
    # commas removed by both
    ("#### 1,234", "1234", ("1234", 1.0), ("1234", 1.0)),
    # '$': the strict regex has no '$' so no answer; flexible drops the '$'
    ("#### $18", "18", (None, 0.0), ("18", 1.0)),
    # negative numbers (flexible: '-5' is too short for the first group, the second takes it)
    ("#### -5", "-5", ("-5", 1.0), ("-5", 1.0)),
    # decimals
    ("#### 3.5", "3.5", ("3.5", 1.0), ("3.5", 1.0)),
    # '#### 72.' extracts '72.' under strict: a wrong answer against '72'
    ("#### 72.", "72", ("72.", 0.1), ("72.", 0.1)),
    # several '####': the last wins
    ("#### 10\nno wait\n#### 12", "12", ("12", 1.0), ("12", 1.0)),
    ("#### 10\nno wait\n#### 12", "10", ("12", 0.1), ("12", 0.1)),
    # strict answer first, a later number: flexible takes the later one
    ("#### 72 (I checked it 5 times)", "72", ("72", 1.0), ("5", 0.1)),
    # '...' after the number is a flexible match that is not just '.': extracted (verl and lm-eval agree)
    ("It is 42 ...", "42", (None, 0.0), ("...", 0.1)),
    # no number at all
    ("I do not know", "72", (None, 0.0), (None, 0.0)),
    # answer before the last 300 characters: not seen by either
    ("#### 72 " + X300, "72", (None, 0.0), (None, 0.0)),
    # exactly 300 characters: '#### 72' (7 chars) + 293 x is all searched
    ("#### 72" + "x" * 293, "72", ("72", 1.0), ("72", 1.0)),
    # 301 characters: the first '#' falls off, '### 72' is no strict answer; flexible still sees 72
    ("#### 72" + "x" * 294, "72", (None, 0.0), ("72", 1.0)),
]


@pytest.mark.parametrize(("response", "truth", "strict", "flexible"), GSM8K_CASES)
def test_gsm8k_strict_and_flexible_by_hand(
    response: str, truth: str, strict: tuple[str | None, float], flexible: tuple[str | None, float]
) -> None:
    for options, (extracted, score) in ((STRICT, strict), (FLEXIBLE, flexible)):
        assert extract_gsm8k(response, options.gsm8k_method) == extracted, options.gsm8k_method
        r = gsm8k_score(response, truth, options)
        assert (r.score, r.extracted, r.correct) == (score, extracted, score == 1.0), options.gsm8k_method


def test_gsm8k_is_registered_under_verl_data_source() -> None:
    assert get_rule_scorer("openai/gsm8k") is gsm8k_score
    assert get_rule_scorer("synthetic/arithmetic") is arithmetic_score
    assert get_rule_scorer("lighteval/MATH") is boxed_math_score


@pytest.mark.parametrize(
    ("response", "truth", "extracted", "score"),
    [
        ("37 + 48 = 85\n85 - 25 = 60\n#### 60", "60", "60", 1.0),
        ("#### 060", "60", "060", 1.0),  # integer compare: 060 == 60
        ("#### 1,060", "1060", "1060", 1.0),
        ("#### -7", "-7", "-7", 1.0),
        ("#### 61", "60", "61", 0.1),
        ("#### 6.5", "6", "6.5", 0.1),  # not an integer: a wrong answer
        ("so it is 60", "60", None, 0.0),  # no '####': no answer
    ],
)
def test_arithmetic_by_hand(response: str, truth: str, extracted: str | None, score: float) -> None:
    r = arithmetic_score(response, truth, STRICT)
    assert (r.extracted, r.score, r.correct) == (extracted, score, score == 1.0)


def test_arithmetic_ground_truth_must_be_an_integer() -> None:
    with pytest.raises(ValueError, match="not an integer"):
        arithmetic_score("#### 3", "three", STRICT)


def test_last_boxed_balances_braces() -> None:
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{{a}{b}}") == "{a}{b}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{5") is None  # never closed


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", 1.0),
        ("\\boxed{ \\left( 1, 2 \\right) }", "(1,2)", 1.0),  # spaces, \left, \right removed
        ("\\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box
        ("\\boxed{7.}", "\\boxed{7}", 1.0),  # trailing '.', boxed ground truth unboxed
        ("\\boxed{1\\!000}", "1000", 1.0),  # \! removed
        ("\\boxed{8}", "9", 0.1),
        ("\\boxed{5", "5", 0.0),  # unclosed: no answer
        ("the answer is 5", "5", 0.0),
    ],
)
def test_boxed_math_by_hand(response: str, truth: str, score: float) -> None:
    assert boxed_math_score(response, truth, STRICT).score == score


def test_unknown_data_source_lists_known_ones() -> None:
    with pytest.raises(DataError) as e:
        score_rules(["#### 1"], ["1"], ["my/data"], STRICT, num_workers=0, parallel_min_samples=1)
    msg = str(e.value)
    assert "'my/data'" in msg and "openai/gsm8k" in msg and "synthetic/arithmetic" in msg


def test_rule_error_is_per_sample() -> None:
    out = score_rules(
        ["#### 1", "#### 2"], ["1", "two"], ["synthetic/arithmetic"] * 2, STRICT,
        num_workers=0, parallel_min_samples=1,
    )  # fmt: skip
    assert out.scores == [1.0, 0.0]
    assert out.errors[0] is None and out.errors[1] is not None and "not an integer" in out.errors[1]


def test_process_pool_equals_in_process() -> None:
    responses = [c[0] for c in GSM8K_CASES] * 5
    truths = [c[1] for c in GSM8K_CASES] * 5
    sources = ["openai/gsm8k"] * len(responses)
    one = score_rules(responses, truths, sources, FLEXIBLE, num_workers=0, parallel_min_samples=1)
    pool = score_rules(responses, truths, sources, FLEXIBLE, num_workers=2, parallel_min_samples=10)
    assert pool == one
    assert one.scores[: len(GSM8K_CASES)] == [c[3][1] for c in GSM8K_CASES]
