"""score_rollouts: weighted combination, DAPO overlong penalty, on_error, metrics, the rewards table."""

from __future__ import annotations

import math
from typing import Any

import pytest

from verl_core.reward import (
    FunctionScorer,
    RewardBatch,
    RewardError,
    RuleOptions,
    RuleScorer,
    ScorerOutput,
    WeightedScorer,
    batch_from_columns,
    metrics_of_rows,
    overlong_penalty,
    rewards_table,
    score_rollouts,
)


def make_batch(lengths: list[int], finish: list[str] | None = None, **cols: list[Any]) -> RewardBatch:
    n = len(lengths)
    return RewardBatch(
        group_id=cols.get("group_id", list(range(n))),
        sample_index=cols.get("sample_index", [0] * n),
        data_source=cols.get("data_source", ["openai/gsm8k"] * n),
        ground_truth=cols.get("ground_truth", ["1"] * n),
        prompt_text=cols.get("prompt_text", ["q"] * n),
        response_text=cols.get("response_text", ["#### 1"] * n),
        response_length=lengths,
        finish_reason=finish or ["stop"] * n,
        extra_info=[{} for _ in range(n)],
    )


class Fixed:
    """A scorer returning fixed scores/errors (and, as a rule scorer would, answers)."""

    def __init__(self, scores: list[float], errors: list[str | None] | None = None, rule: bool = False):
        self.out = ScorerOutput(
            scores,
            errors or [None] * len(scores),
            [str(s) if s else None for s in scores] if rule else None,
            [s == 1.0 for s in scores] if rule else None,
        )

    def __call__(self, batch: RewardBatch) -> ScorerOutput:
        return self.out


def test_overlong_penalty_by_hand() -> None:
    # L_max 10, L_cache 4: free up to 6, then (6 - len) / 4 down to -1 at 10, -1 beyond
    got = overlong_penalty([5, 6, 7, 8, 10, 11], max_response_length=10, buffer_len=4)
    assert got == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match=r"1\.\.10"):
        overlong_penalty([1], max_response_length=10, buffer_len=11)


def test_weighted_combination_with_overlong_penalty_and_metrics() -> None:
    batch = make_batch([4, 8, 10], finish=["stop", "stop", "length"])
    scorers = [
        WeightedScorer("rule", 2.0, Fixed([1.0, 0.0, 0.1], rule=True)),
        WeightedScorer("bonus", 0.5, Fixed([2.0, 4.0, -2.0])),
    ]
    r = score_rollouts(
        batch, scorers, on_error="fail", max_response_length=10,
        overlong_buffer_len=4, overlong_penalty_factor=0.5,
    )  # fmt: skip
    # rule 2×[1, 0, 0.1] = [2, 0, 0.2]; bonus 0.5×[2, 4, -2] = [1, 2, -1];
    # overlong 0.5 × p([4, 8, 10]; L_max 10, L_cache 4) = 0.5 × [0, -0.5, -1] = [0, -0.25, -0.5]
    assert r.components == [
        {"rule": 2.0, "bonus": 1.0, "overlong": 0.0},
        {"rule": 0.0, "bonus": 2.0, "overlong": -0.25},
        {"rule": pytest.approx(0.2), "bonus": -1.0, "overlong": -0.5},
    ]
    assert r.scores == pytest.approx([3.0, 1.75, -1.3])
    assert r.extracted == ["1.0", None, "0.1"] and r.correct == [True, False, False]
    m = r.metrics
    # mean 3.45 / 3 = 1.15; deviations 1.85, 0.6, -2.45 → squares sum 9.785 → std sqrt(9.785 / 3)
    assert m["critic/score/mean"] == pytest.approx(1.15)
    assert m["critic/score/std"] == pytest.approx(math.sqrt(9.785 / 3))
    assert (m["critic/score/max"], m["critic/score/min"]) == (pytest.approx(3.0), pytest.approx(-1.3))
    assert m["reward/accuracy"] == pytest.approx(1 / 3)
    assert m["reward/no_answer_frac"] == pytest.approx(1 / 3)
    assert m["reward/errors"] == 0.0
    assert m["reward/overlong/mean"] == pytest.approx(-0.75 / 3)
    assert m["response_length/mean"] == pytest.approx(22 / 3)  # (4 + 8 + 10) / 3
    assert m["response_length/max"] == 10.0
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)  # one finish_reason "length"


def test_without_a_rule_scorer_correct_means_score_at_least_the_threshold() -> None:
    # partial credit 0.3 / 0.7 / exact 1.0: with the default threshold 1.0 only the last is correct
    # (validation and eval used to disagree here: mean score 0.667 vs fraction with score > 0 = 1.0)
    scorer = [WeightedScorer("function", 1.0, Fixed([0.3, 0.7, 1.0]))]
    r = score_rollouts(make_batch([1, 1, 1]), scorer, on_error="fail", max_response_length=4)
    assert r.extracted == [None, None, None] and r.correct == [False, False, True]
    assert r.metrics["reward/accuracy"] == pytest.approx(1 / 3)
    assert "reward/no_answer_frac" not in r.metrics
    half = score_rollouts(
        make_batch([1, 1, 1]), scorer, on_error="fail", max_response_length=4, correct_threshold=0.5
    )
    assert half.correct == [False, True, True]


def test_metrics_of_rows_leave_other_rows_out() -> None:
    # rows 0 and 2 only: scores 0.3 and 1.0 → mean 0.65, accuracy 1/2
    scorer = [WeightedScorer("function", 1.0, Fixed([0.3, 0.7, 1.0]))]
    batch = make_batch([1, 1, 1])
    r = score_rollouts(batch, scorer, on_error="fail", max_response_length=4)
    m = metrics_of_rows(batch, r, [0, 2])
    assert m["critic/score/mean"] == pytest.approx(0.65) and m["reward/accuracy"] == 0.5


def test_on_error_fail_names_the_row() -> None:
    batch = make_batch([1, 1], group_id=[3, 3], sample_index=[0, 1], data_source=["openai/gsm8k", "d/x"])
    bad = WeightedScorer("function", 1.0, Fixed([1.0, 0.0], errors=[None, "RuntimeError: kaboom"]))
    with pytest.raises(RewardError) as e:
        score_rollouts(batch, [bad], on_error="fail", max_response_length=4)
    msg = str(e.value)
    assert "group_id=3, sample_index=1" in msg and "'d/x'" in msg and "RuntimeError: kaboom" in msg
    assert "'function'" in msg


def test_on_error_zero_scores_zero_and_counts() -> None:
    batch = make_batch([1, 1, 1])
    scorers = [
        WeightedScorer("function", 2.0, Fixed([0.5, 0.5, 0.5], errors=[None, "boom", "boom"])),
        WeightedScorer("model", 1.0, Fixed([0.25, 0.25, 0.25])),
    ]
    r = score_rollouts(batch, scorers, on_error="zero", max_response_length=4)
    # row 0: 2×0.5 + 0.25 = 1.25; rows 1, 2: the function's term is 0 → 0.25
    assert r.scores == [1.25, 0.25, 0.25]
    assert r.components[1] == {"function": 0.0, "model": 0.25}
    assert r.errors == [None, "function: boom", "function: boom"]
    assert r.metrics["reward/errors"] == 2.0


def test_real_rule_and_function_scorers_together(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "len_reward_mod.py").write_text(
        "def f(c, *, ground_truth, data_source, extra_info):\n    return len(c) / 10\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from verl_core.reward import load_reward_function

    batch = make_batch([6, 6], response_text=["#### 1", "#### 2"], ground_truth=["1", "1"])
    scorers = [
        WeightedScorer("rule", 1.0, RuleScorer(RuleOptions("strict", 1.0, 0.0), 0, 100)),
        WeightedScorer(
            "function", 0.5, FunctionScorer(load_reward_function("len_reward_mod:f"), "sample", 5)
        ),
    ]
    r = score_rollouts(batch, scorers, on_error="fail", max_response_length=8)
    # rule [1, 0] + 0.5 × len("#### N") / 10 = 0.5 × 0.6 = 0.3
    assert r.scores == pytest.approx([1.3, 0.3])
    assert r.extracted == ["1", "2"] and r.correct == [True, False]


def test_batch_from_columns_and_rewards_table() -> None:
    cols = {
        "group_id": [0, 0], "sample_index": [0, 1], "data_source": ["openai/gsm8k"] * 2,
        "ground_truth": ["1", "1"], "prompt_text": ["p", "p"], "response_text": ["#### 1", "no"],
        "response_length": [3, 1], "finish_reason": ["stop", "stop"], "prompt_index": [17, 17],
    }  # fmt: skip
    batch = batch_from_columns(cols)
    assert batch.extra_info[1] == {"group_id": 0, "sample_index": 1, "prompt_index": 17,
                                   "finish_reason": "stop", "response_length": 1}  # fmt: skip
    rule = RuleScorer(RuleOptions("strict", 1.0, 0.0), 0, 100)
    r = score_rollouts(batch, [WeightedScorer("rule", 1.0, rule)], on_error="fail", max_response_length=4)
    table = rewards_table(batch, r)
    assert table.to_pylist() == [
        {"group_id": 0, "sample_index": 0, "score": 1.0, "components": [("rule", 1.0)],
         "extracted_answer": "1", "correct": True},
        {"group_id": 0, "sample_index": 1, "score": 0.0, "components": [("rule", 0.0)],
         "extracted_answer": None, "correct": False},
    ]  # fmt: skip
    del cols["ground_truth"]
    with pytest.raises(Exception, match="lack column"):
        batch_from_columns(cols)


def test_batch_from_columns_passes_the_dataset_row_s_extra_info() -> None:
    # a rollouts table with the dataset row's extra_info (verl's gsm8k keys): the function's
    # extra_info is that dict (null keys left out, as a row that lacks them) plus the rollout's own
    # columns; on a shared key the dataset's value wins (row 1 has its own "group_id": 7, not 0)
    cols = {
        "group_id": [0, 0], "sample_index": [0, 1], "data_source": ["openai/gsm8k"] * 2,
        "ground_truth": ["1", "1"], "prompt_text": ["p", "p"], "response_text": ["#### 1", "no"],
        "response_length": [3, 1], "finish_reason": ["stop", "stop"],
        "extra_info": [{"split": "train", "index": 41, "answer": "#### 1", "question": None},
                       {"split": "test", "index": 42, "group_id": 7}],
    }  # fmt: skip
    batch = batch_from_columns(cols)
    assert batch.extra_info[0] == {"group_id": 0, "sample_index": 0, "finish_reason": "stop",
                                   "response_length": 3, "split": "train", "index": 41,
                                   "answer": "#### 1"}  # fmt: skip
    assert batch.extra_info[1]["split"] == "test" and batch.extra_info[1]["index"] == 42
    assert batch.extra_info[1]["group_id"] == 7
    # a null extra_info (prompts written before it was carried): the rollout's columns alone
    cols["extra_info"] = [None, None]
    alone = {"group_id": 0, "sample_index": 1, "finish_reason": "stop", "response_length": 1}
    assert batch_from_columns(cols).extra_info[1] == alone
