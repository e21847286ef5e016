"""Rule scorers: one pure function per family of ``data_source``, as verl's ``default_compute_score``.

Every rule scorer has one signature, ``(response, ground_truth, options) -> RuleScore``, and is found by
the row's ``data_source`` in :data:`RULE_SCORERS` (an unknown data_source fails with the known ones):

``openai/gsm8k`` (verl ``utils/reward_score/gsm8k.py``)
    Only the last 300 characters of the response are searched (verl's ``_SOLUTION_CLIP_CHARS``).

    * ``strict``: the last match of ``#### (-?[0-9.,]+)``, commas and ``$`` removed. The regex has no
      ``$``, so ``#### $18`` has no answer, and ``#### 18.`` extracts ``18.`` (wrong against ``18``).
      **A response without ``####`` scores a silent 0**, however right its last number is: that is
      what ``reward/no_answer_frac`` (the fraction of responses with no extractable answer) shows.
    * ``flexible``: the last number, regex ``(-?[$0-9.,]{2,})|(-?[0-9]+)`` (lm-eval-harness's
      flexible-extract); the last match that, with commas and ``$`` removed, is neither empty nor
      ``.``.

    Exact string match with the ground truth → ``options.score``; an answer that does not match →
    ``options.format_score``; no answer → 0.
``synthetic/arithmetic``
    The same ``#### N`` convention as gsm8k strict; answer and ground truth compared as integers
    (``#### 060`` is right for ``60``; ``#### 6.5`` is a wrong answer). Same three outcomes.
``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``, ``math``
    The last ``\\boxed{...}`` (balanced braces) of the response; both it and the ground truth (itself
    unboxed first if it holds a ``\\boxed{}``) are lightly normalised: spaces, ``\\left``/``\\right``,
    ``\\!`` and a trailing ``.`` removed; then compared as strings.

The functions are pure and module-level, so a process pool can run them (see
:mod:`verl_core.reward.scoring`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal, NamedTuple

from verl_core.registry import Registry

GSM8KMethod = Literal["strict", "flexible"]

# verl: "regular expression matching on very long strings can be slow" - only the tail is searched.
SOLUTION_CLIP_CHARS = 300

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


class RuleOptions(NamedTuple):
    """What a rule scorer gives: ``score`` when right, ``format_score`` when an answer is there but
    wrong (0 when there is none); ``gsm8k_method`` chooses the GSM8K extraction."""

    gsm8k_method: GSM8KMethod
    score: float
    format_score: float


class RuleScore(NamedTuple):
    """One response's rule score, the answer extracted from it (None: no answer) and whether it is right."""

    score: float
    extracted: str | None
    correct: bool


RuleScoreFn = Callable[[str, str, RuleOptions], RuleScore]

RULE_SCORERS: Registry[RuleScoreFn] = Registry("data_source for the rule scorer")


def register_rule(*data_sources: str) -> Callable[[RuleScoreFn], RuleScoreFn]:
    """Register a rule scorer for each of ``data_sources``."""

    def decorator(fn: RuleScoreFn) -> RuleScoreFn:
        for name in data_sources:
            RULE_SCORERS.register(name)(fn)
        return fn

    return decorator


def get_rule_scorer(data_source: str) -> RuleScoreFn:
    """The rule scorer of ``data_source``; ``UnknownNameError`` lists the known data sources."""
    return RULE_SCORERS.get(data_source)


def _outcome(extracted: str | None, correct: bool, options: RuleOptions) -> RuleScore:
    if extracted is None:
        return RuleScore(0.0, None, False)
    return RuleScore(options.score if correct else options.format_score, extracted, correct)


# --------------------------------------------------------------------------------------------------
# GSM8K


def extract_gsm8k(response: str, method: GSM8KMethod) -> str | None:
    """The answer verl's GSM8K scorer reads from ``response`` (None: none), see the module docstring."""
    tail = response[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for strict_like, short in reversed(_FLEXIBLE.findall(tail)):
        candidate = (strict_like or short).replace(",", "").replace("$", "")
        if candidate not in ("", "."):
            return candidate
    return None


@register_rule("openai/gsm8k")
def gsm8k_score(response: str, ground_truth: str, options: RuleOptions) -> RuleScore:
    """verl's ``gsm8k.compute_score``: exact string match of the extracted answer."""
    answer = extract_gsm8k(response, options.gsm8k_method)
    return _outcome(answer, answer == ground_truth, options)


# --------------------------------------------------------------------------------------------------
# Synthetic arithmetic


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


@register_rule("synthetic/arithmetic")
def arithmetic_score(response: str, ground_truth: str, options: RuleOptions) -> RuleScore:
    """``#### N`` (gsm8k strict extraction) compared as an integer with the ground truth.

    Raises ValueError when the ground truth is not an integer (a data problem, not a wrong answer)."""
    truth = _as_int(ground_truth.strip())
    if truth is None:
        raise ValueError(f"ground truth {ground_truth!r} is not an integer")
    answer = extract_gsm8k(response, "strict")
    value = None if answer is None else _as_int(answer)
    return _outcome(answer, value is not None and value == truth, options)


# --------------------------------------------------------------------------------------------------
# \boxed{} math


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` with balanced braces (None: none, or unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def normalize_math(answer: str) -> str:
    """Light normalisation of a math answer: no spaces, ``\\left``/``\\right``/``\\!``, trailing ``.``."""
    out = answer.replace("\\left", "").replace("\\right", "").replace("\\!", "")
    out = "".join(out.split())
    return out.rstrip(".")


@register_rule("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")
def boxed_math_score(response: str, ground_truth: str, options: RuleOptions) -> RuleScore:
    """The last ``\\boxed{}`` of the response against the (unboxed) ground truth, normalised strings."""
    answer = last_boxed(response)
    truth = last_boxed(ground_truth)
    truth = ground_truth if truth is None else truth
    return _outcome(answer, answer is not None and normalize_math(answer) == normalize_math(truth), options)
