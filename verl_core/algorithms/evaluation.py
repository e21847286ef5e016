"""Evaluation metrics: the unbiased pass@k estimator and accuracy per data source.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with n samples
of a prompt of which c are correct, the probability that at least one of k samples drawn without
replacement is correct is

    pass@k = 1 - C(n - c, k) / C(n, k)

computed as a product to stay exact for large n: 1 - prod_{i=n-c+1}^{n} (1 - k / i).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``n`` samples, ``c`` of them correct (``k <= n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k samples contains a correct one
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


class SourceAccuracy(NamedTuple):
    """Accuracy of one data source: ``prompts`` evaluated, mean of the per-prompt values."""

    prompts: int
    accuracy: float


def mean_by_source(sources: Sequence[str], values: Sequence[float]) -> dict[str, SourceAccuracy]:
    """Mean of ``values`` (one per prompt) grouped by ``sources`` (same length), sorted by source."""
    if len(sources) != len(values):
        raise ValueError(f"mean_by_source: {len(sources)} sources for {len(values)} values")
    groups: dict[str, list[float]] = defaultdict(list)
    for s, v in zip(sources, values, strict=True):
        groups[s].append(float(v))
    return {s: SourceAccuracy(len(v), sum(v) / len(v)) for s, v in sorted(groups.items())}


def per_prompt_correct(group_ids: Sequence[int], correct: Sequence[bool]) -> dict[int, tuple[int, int]]:
    """``{group_id: (n samples, c correct)}`` from per-sample rows."""
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for g, ok in zip(group_ids, correct, strict=True):
        counts[int(g)][0] += 1
        counts[int(g)][1] += int(bool(ok))
    return {g: (n, c) for g, (n, c) in sorted(counts.items())}
