"""A stricter answer rule for the quickstart's synthetic arithmetic, the worked example of
``verl-flow rescore`` (README, "Rescoring stored rollouts"): the built-in rule
(``verl_core.reward.rules.arithmetic_score``) reads only the final ``#### N``; this one also wants
every worked line the response shows to be a right step ``a op b = c`` and nothing after the answer,
so a right answer reached through a wrong line, or followed by more text, scores 0.

Batch form of a custom reward function (``reward.function_mode=batch``, verl_core.reward.functions)::

    PYTHONPATH=. verl-flow rescore RUN_ID 'reward.scorers=[function]' \\
        reward.function=examples.strict_arithmetic:worked_steps reward.function_mode=batch

Without a rule scorer a sample is correct when its score is >= ``reward.correct_threshold`` (1.0).
"""

from __future__ import annotations

import re
from typing import Any

_STEP = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*(-?\d+)\s*$")
_ANSWER = re.compile(r"^#### (-?\d+)$")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def worked_steps(
    completions: list[str],
    *,
    ground_truths: list[str],
    data_sources: list[str],
    extra_infos: list[dict[str, Any]],
) -> list[float]:
    """1.0 per response whose last line is ``#### N`` with N the ground truth and whose other lines
    are all right steps ``a op b = c``; else 0.0."""
    return [_score(c, t) for c, t in zip(completions, ground_truths, strict=True)]


def _score(response: str, ground_truth: str) -> float:
    lines = response.strip().splitlines()
    answer = _ANSWER.match(lines[-1].strip()) if lines else None
    if answer is None or int(answer.group(1)) != int(ground_truth.strip()):
        return 0.0
    for line in lines[:-1]:
        step = _STEP.match(line)
        if step is None:
            return 0.0
        a, op, b, c = int(step.group(1)), step.group(2), int(step.group(3)), int(step.group(4))
        if _APPLY[op](a, b) != c:
            return 0.0
    return 1.0
