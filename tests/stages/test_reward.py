"""The reward stage end to end on a hand-built rollouts table: rewards, report, metrics, skip, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from stages.reward import REWARDS_FILE, reward
from verl_core.config import RewardConfig, SandboxConfig
from verl_core.reward import RewardError
from verl_core.runtime import sandbox
from verl_core.runtime.run import RunContext
from verl_core.store import get_schema

# (group_id, sample_index, response, ground truth, finish_reason, response_length)
ROWS = [
    (0, 0, "48 + 24 = 72\n#### 72", "72", "stop", 10),  # right
    (0, 1, "48 + 23 = 71\n#### 71", "72", "stop", 12),  # wrong answer: format_score 0
    (1, 0, "I think it is 5", "5", "length", 16),  # strict: no '####', no answer; overlong
    (1, 1, "2 + 3 = 5\n#### 5", "5", "stop", 6),  # right
]


def rollouts_table() -> pa.Table:
    rows = [
        {
            "iteration": 0, "group_id": g, "sample_index": s, "prompt_index": 100 + g,
            "data_source": "openai/gsm8k", "ground_truth": gt, "prompt_text": f"<q{g}>",
            "prompt_ids": [1, 2], "response_ids": [3] * n, "response_text": text,
            "logprobs": [-0.5] * n, "finish_reason": fin, "prompt_length": 2, "response_length": n,
            "policy_version": 0,
        }
        for g, s, text, gt, fin, n in ROWS
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=get_schema("rollouts"))


class Spy:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((dict(metrics), step))


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[RunContext, str, Spy]:
    ctx = RunContext(run_id="rl", store_url=str(tmp_path / "store"))
    stage = ctx.store().open_stage(ctx.run_id, "iter-0000/rollout")
    stage.write_table("rollouts.parquet", rollouts_table(), "rollouts")
    uri = stage.commit()
    spy = Spy()
    monkeypatch.setattr(RunContext, "tracker", lambda self: spy)
    return ctx, uri, spy


def test_stage_scores_writes_reports_and_skips_on_rerun(run: tuple[RunContext, str, Spy]) -> None:
    ctx, rollout_uri, spy = run
    cfg = RewardConfig(overlong_buffer_len=4)  # L_max 16, L_cache 4: lengths 13..16 are penalised
    uri = reward.fn(ctx, cfg, rollout_uri, 0, 16, sandbox=SandboxConfig())
    store = ctx.store()
    m = store.read_manifest(uri)
    assert m.stage == "iter-0000/reward"
    df = pd.read_parquet(store.file_uri(m, REWARDS_FILE))
    # rule [1, 0, 0, 1]; overlong p(10, 12, 16, 6) = [0, 0, (12 - 16) / 4 = -1, 0]
    assert df["score"].tolist() == [1.0, 0.0, -1.0, 1.0]
    assert df["group_id"].tolist() == [0, 0, 1, 1] and df["sample_index"].tolist() == [0, 1, 0, 1]
    assert [dict(c) for c in df["components"]] == [
        {"rule": 1.0, "overlong": 0.0},
        {"rule": 0.0, "overlong": 0.0},
        {"rule": 0.0, "overlong": -1.0},
        {"rule": 1.0, "overlong": 0.0},
    ]
    assert df["extracted_answer"].isna().tolist() == [False, False, True, False]  # null: no answer
    assert df["extracted_answer"].dropna().tolist() == ["72", "71", "5"]
    assert df["correct"].tolist() == [True, False, False, True]

    [(metrics, step)] = spy.logged
    assert step == 0
    summary = m.summary["metrics"]  # the batch means the update logs: in the stage's summary, not logged
    assert "critic/score/mean" not in metrics and "response_length/mean" not in metrics
    assert summary["critic/score/mean"] == pytest.approx(0.25)  # (1 + 0 - 1 + 1) / 4
    assert (metrics["critic/score/max"], metrics["critic/score/min"]) == (1.0, -1.0)
    assert metrics["reward/accuracy"] == 0.5  # 2 of 4
    assert metrics["reward/no_answer_frac"] == 0.25  # row (1, 0)
    assert metrics["reward/errors"] == 0.0
    assert summary["response_length/mean"] == 11.0  # (10 + 12 + 16 + 6) / 4
    assert metrics["response_length/max"] == 16.0
    assert metrics["response_length/clip_ratio"] == 0.25  # one finish_reason "length"
    report = json.loads(store.read_bytes(m, "report.json"))
    assert report["rows"] == 4 and report["errors"] == 0 and report["scorers"] == {"rule": 1.0}

    # rerun: committed with the same inputs → the same manifest, nothing rescored or logged
    assert reward.fn(ctx, cfg, rollout_uri, 0, 16, sandbox=SandboxConfig()) == uri
    assert store.read_manifest(uri).attempt == m.attempt
    assert len(spy.logged) == 1
    # another config → a new attempt
    reward.fn(ctx, RewardConfig(), rollout_uri, 0, 16, sandbox=SandboxConfig())
    assert store.read_manifest(uri).attempt != m.attempt


def _user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "stage_reward_mod.py").write_text(
        "def f(c, *, ground_truth, data_source, extra_info):\n"
        "    if extra_info['group_id'] == 1 and extra_info['sample_index'] == 0:\n"
        "        raise ValueError('cannot score this one')\n"
        "    return 0.5\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "stage_reward_mod:f"


def test_function_error_fails_naming_the_row_or_is_zeroed(
    run: tuple[RunContext, str, Spy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx, rollout_uri, spy = run
    fn = _user_module(tmp_path, monkeypatch)
    cfg: Any = RewardConfig(scorers=["rule", {"name": "function", "weight": 2.0}], function=fn)
    with pytest.raises(RewardError, match=r"group_id=1, sample_index=0.*openai/gsm8k.*cannot score this one"):
        reward.fn(ctx, cfg, rollout_uri, 0, 16, sandbox=SandboxConfig())
    assert ctx.store().committed(ctx.run_id, "iter-0000/reward") is None

    uri = reward.fn(
        ctx, cfg.model_copy(update={"on_error": "zero"}), rollout_uri, 0, 16, sandbox=SandboxConfig()
    )
    store = ctx.store()
    m = store.read_manifest(uri)
    df = pd.read_parquet(store.file_uri(m, REWARDS_FILE))
    # rule [1, 0, 0, 1] + 2 × 0.5 except the failed row (1, 0)
    assert df["score"].tolist() == [2.0, 1.0, 0.0, 2.0]
    assert spy.logged[-1][0]["reward/errors"] == 1.0
    report = json.loads(store.read_bytes(m, "report.json"))
    assert report["errors"] == 1
    assert report["error_examples"][0]["row"] == "group_id=1, sample_index=0"


@pytest.mark.skipif(sandbox.bwrap_problem() is not None, reason="bubblewrap cannot run here (`make install`)")
def test_code_scorer_through_the_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The code scorer in the stage: the sandbox section reaches it and is part of the stage's inputs;
    a crashing response scores 0 and is counted, the stage does not fail (on_error is 'fail')."""
    tests = "assert add(1, 2) == 3\nassert add(2, 2) == 4"
    responses = [
        "```python\ndef add(a, b):\n    return a + b\n```",  # 2 of 2
        "```python\ndef add(a, b):\n    return 3\n```",  # 1 of 2
        "```python\nraise SystemError('crash')\n```",  # 0, a failure
    ]
    rows = [
        {
            "iteration": 0, "group_id": i, "sample_index": 0, "prompt_index": i,
            "data_source": "mbpp-style/handwritten", "ground_truth": tests, "prompt_text": "q",
            "prompt_ids": [1], "response_ids": [2], "response_text": text, "logprobs": [-0.5],
            "finish_reason": "stop", "prompt_length": 1, "response_length": 1, "policy_version": 0,
        }
        for i, text in enumerate(responses)
    ]  # fmt: skip
    ctx = RunContext(run_id="rl", store_url=str(tmp_path / "store"))
    stage = ctx.store().open_stage(ctx.run_id, "iter-0000/rollout")
    stage.write_table(
        "rollouts.parquet", pa.Table.from_pylist(rows, schema=get_schema("rollouts")), "rollouts"
    )
    rollout_uri = stage.commit()
    spy = Spy()
    monkeypatch.setattr(RunContext, "tracker", lambda self: spy)
    cfg = RewardConfig(scorers=["code"])
    uri = reward.fn(ctx, cfg, rollout_uri, 0, 16, sandbox=SandboxConfig(timeout_s=2.0))
    df = pd.read_parquet(ctx.store().file_uri(ctx.store().read_manifest(uri), REWARDS_FILE))
    assert df["score"].tolist() == [1.0, 0.5, 0.0]
    metrics, _ = spy.logged[-1]
    assert metrics["reward/code/failures"] == 1.0 and metrics["reward/errors"] == 0.0
    # the same limits: skipped; other sandbox limits are other inputs: a new attempt
    attempt = ctx.store().read_manifest(uri).attempt
    reward.fn(ctx, cfg, rollout_uri, 0, 16, sandbox=SandboxConfig(timeout_s=2.0))
    assert len(spy.logged) == 1
    reward.fn(ctx, cfg, rollout_uri, 0, 16, sandbox=SandboxConfig(timeout_s=3.0))
    assert ctx.store().read_manifest(uri).attempt != attempt and len(spy.logged) == 2


def test_each_metric_is_logged_once_per_step(run: tuple[RunContext, str, Spy]) -> None:
    """The update logs its batch's figures at the same step (verl_core.training.ppo_metrics.batch_metrics):
    the reward stage logs none of them (before: critic/score/mean and response_length/mean twice)."""
    import torch

    from verl_core.training.ppo_metrics import batch_metrics

    ctx, rollout_uri, spy = run
    reward.fn(ctx, RewardConfig(), rollout_uri, 0, 16, sandbox=SandboxConfig())
    [(logged, _)] = spy.logged
    s, r = 2, 3  # any batch: only the names matter
    zeros = torch.zeros(s, r)
    update = batch_metrics(torch.ones(s), zeros, zeros, zeros, zeros, torch.ones(s, r), torch.tensor([0, 0]))
    assert set(logged) & set(update) == set()


VERL_SCORE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # verl's custom reward signature; reads the keys verl's gsm8k preprocessing writes
    assert extra_info["question"].startswith("What is")
    return float(extra_info["index"]) if extra_info["split"] == "train-v2" else -1.0
"""


def test_a_verl_function_gets_the_dataset_row_s_extra_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's parquet (its extra_info struct) → preprocess → template_pack → rollouts → the function:
    extra_info['split'] and ['index'] are the row's. Before the rollouts carried it, the function got
    the rollout's columns only and every sample failed (KeyError: 'question')."""
    import pyarrow.parquet as pq

    from stages.floor.artifacts import rollouts_table as build_rollouts
    from stages.preprocess import preprocess
    from stages.template_pack import template_pack
    from verl_core.config import DataConfig, ModelConfig
    from verl_core.rollout import Completion

    def verl_rows(first: int, split: str) -> pa.Table:
        rows = [
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
                # index 7i + 3: not a row position, so only the row's own value can match
                "extra_info": {"split": split, "index": 7 * i + 3, "answer": f"#### {i + 1}",
                               "question": f"What is {i} + 1?"},
            }
            for i in range(first, first + 6)
        ]  # fmt: skip
        return pa.Table.from_pylist(rows, schema=get_schema("prompts"))

    pq.write_table(verl_rows(0, "train-v2"), tmp_path / "train.parquet")
    pq.write_table(verl_rows(100, "test"), tmp_path / "test.parquet")
    (tmp_path / "score.py").write_text(VERL_SCORE)
    monkeypatch.setattr(RunContext, "tracker", lambda self: Spy())
    ctx = RunContext(run_id="verl", store_url=str(tmp_path / "store"))
    data = DataConfig(
        source="parquet",
        train_files=[str(tmp_path / "train.parquet")],
        val_files=[str(tmp_path / "test.parquet")],
    )
    store = ctx.store()
    packed = store.read_manifest(template_pack.fn(ctx, data, ModelConfig(), preprocess.fn(ctx, data)))
    prompts = store.read_table(packed, "prompt_tokens/train.parquet")
    # two hand-made samples of each prompt, as the rollout stage makes them
    completions = [
        Completion(p, s, [1, 2], [3], "#### 0", [-0.5], "stop")
        for p in range(prompts.num_rows)
        for s in range(2)
    ]
    stage = store.open_stage(ctx.run_id, "iter-0000/rollout")
    stage.write_table("rollouts.parquet", build_rollouts(completions, prompts, 0, 0), "rollouts")
    cfg = RewardConfig(scorers=[{"name": "function"}], function=f"{tmp_path / 'score.py'}:compute_score")
    uri = reward.fn(ctx, cfg, stage.commit(), 0, 16, sandbox=SandboxConfig())
    rollouts = store.read_table(store.read_manifest(stage.manifest_uri), "rollouts.parquet")
    scores = store.read_table(store.read_manifest(uri), REWARDS_FILE).column("score").to_pylist()
    # each sample scores its row's index (7i + 3, i = 0..5, two samples each): the row's split matched
    assert sorted(scores) == sorted(float(7 * i + 3) for i in range(6) for _ in range(2))
    assert scores == [float(i) for i in rollouts.column("prompt_index").to_pylist()]
