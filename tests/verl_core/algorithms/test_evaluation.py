"""pass@k and per-source accuracy, against values worked out by hand."""

from __future__ import annotations

import pytest

from verl_core.algorithms.evaluation import mean_by_source, pass_at_k, per_prompt_correct


def test_pass_at_k_hand_computed() -> None:
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # c / n
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10 = 0.9
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(4, 2, 3) == 1.0  # n - c = 2 < k: every draw of 3 holds a correct one
    assert pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_grouping() -> None:
    assert per_prompt_correct([0, 0, 1, 1, 1], [True, False, False, False, True]) == {0: (2, 1), 1: (3, 1)}
    by = mean_by_source(["gsm8k", "arith", "gsm8k"], [1.0, 0.0, 0.0])
    assert by["gsm8k"].prompts == 2 and by["gsm8k"].accuracy == 0.5
    assert list(by) == ["arith", "gsm8k"] and by["arith"].accuracy == 0.0
