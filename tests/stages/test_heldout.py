"""Held-out passes on a scripted engine: the passes generated in order with their sampling, scored by
the rule scorer, written under their folders; accuracy and pass@k counted by hand."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from stages.floor.heldout import generate_passes, greedy_sampling, sampled_sampling, score_passes
from stages.floor.scorers import build_scorers
from verl_core.config import EvalConfig, MultiTurnConfig, RewardConfig, SandboxConfig
from verl_core.rollout import Completion, SamplingParams
from verl_core.store import ArtifactStore

PROMPTS = pa.table(
    {
        "index": [10, 11],
        "data_source": ["openai/gsm8k"] * 2,
        "ground_truth": ["1", "2"],
        "prompt_text": ["q0", "q1"],
        "input_ids": [[1, 2], [3]],
    }
)
# greedy: prompt 0 right, prompt 1 wrong; sampled (4 each): prompt 0 right twice, prompt 1 never
ANSWERS = {1: [["#### 1"], ["#### 9"]], 4: [["#### 1", "#### 1", "#### 9", "#### 9"], ["#### 9"] * 4]}


class ScriptedEngine:
    """Answers prompt p's sample s with ``ANSWERS[n][p][s]``; records each call's sampling."""

    policy_version = 0

    def __init__(self) -> None:
        self.calls: list[SamplingParams] = []

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, prompt_keys: object = None
    ) -> list[Completion]:
        self.calls.append(params)
        return [
            Completion(p, s, list(ids), [5, 6], ANSWERS[params.n][p][s], [-0.1, -0.2], "stop")
            for p, ids in enumerate(prompt_ids)
            for s in range(params.n)
        ]


def test_eval_sampling_greedy_and_k_samples() -> None:
    e = EvalConfig(k=4, temperature=0.7, top_p=0.9, seed=3)
    assert greedy_sampling(e, 16, ["\n\n"]) == SamplingParams(
        n=1, temperature=0.0, seed=3, max_new_tokens=16, stop=("\n\n",)
    )
    assert sampled_sampling(e, 16, ["\n\n"]) == SamplingParams(
        n=4, temperature=0.7, top_p=0.9, seed=3, max_new_tokens=16, stop=("\n\n",)
    )
    assert sampled_sampling(e.model_copy(update={"k": 1}), 16, []) is None  # no sampled pass


def test_passes_are_generated_scored_and_written_in_order(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8, seed=1)
    sampled = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=2)
    ids = PROMPTS.column("input_ids").to_pylist()
    passes = {"": greedy, "sampled/": sampled}
    generated = generate_passes(engine, None, ids, passes, MultiTurnConfig(), 8, SandboxConfig())  # type: ignore[arg-type]
    assert engine.calls == [greedy, sampled] and list(generated) == ["", "sampled/"]
    assert all(g.seconds >= 0 and g.rollouts.trajectories is None for g in generated.values())

    store = ArtifactStore(str(tmp_path))
    stage = store.open_stage("h", "iter-0002/val")
    reward = RewardConfig()
    scored = score_passes(
        stage, PROMPTS, generated, build_scorers(reward, SandboxConfig()),
        reward=reward, sandbox=SandboxConfig(), max_response_length=8, iteration=2, policy_version=0,
    )  # fmt: skip
    stage.commit()
    m = store.committed("h", "iter-0002/val")
    assert m is not None
    assert [f.name for f in m.files] == [
        "rollouts.parquet", "rewards.parquet", "sampled/rollouts.parquet", "sampled/rewards.parquet"
    ]  # fmt: skip
    g, s = scored[""], scored["sampled/"]
    assert store.read_table(m, "sampled/rewards.parquet").column("correct").to_pylist() == list(
        s.result.correct
    )
    assert g.rollouts.column("iteration").to_pylist() == [2, 2]
    assert g.rollouts.column("group_id").to_pylist() == [0, 1]
    # greedy: 1 of 2 right → accuracy 0.5; sampled: (n, c) = (4, 2) and (4, 0)
    assert g.accuracy == 0.5
    assert s.per_prompt == {0: (4, 2), 1: (4, 0)}
    assert s.accuracy == 2 / 8
    # pass@1 = mean(2/4, 0) = 0.25; pass@4 = mean(1, 0) = 0.5 (prompt 0 has a right sample)
    # pass@2 of (4, 2) = 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6; mean(5/6, 0) = 5/12
    assert s.pass_at_k_each(4) == [1.0, 0.0]
    assert (s.pass_at(1), s.pass_at(4)) == (0.25, 0.5)
    assert abs(s.pass_at(2) - 5 / 12) < 1e-12
