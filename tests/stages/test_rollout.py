"""Rollout stage helpers: sampling parameters for training vs validation, the rollouts table (the
prompt batches: tests/verl_core/data/test_prompt_stream.py)."""

from __future__ import annotations

import pyarrow as pa

from stages.floor.artifacts import rollouts_table
from stages.floor.rollouts import sampling_params
from verl_core.config import RolloutConfig
from verl_core.rollout import Completion
from verl_core.seeding import derive_seed


def test_sampling_params_training_vs_validation() -> None:
    cfg = RolloutConfig(
        n=4, temperature=0.8, top_p=0.9, top_k=20, stop=["\n\n"], seed=2, val_temperature=0.0, val_n=2
    )
    train = sampling_params(cfg, 48, 5, validation=False)
    assert (train.n, train.temperature, train.top_p, train.top_k) == (4, 0.8, 0.9, 20)
    assert train.max_new_tokens == 48 and train.stop == ("\n\n",)
    assert train.seed == derive_seed("rollout", 2, 5)  # seeded by (rollout.seed, iteration)
    assert not train.greedy
    val = sampling_params(cfg, 48, 5, validation=True)
    # validation: val_n samples, val_temperature, no nucleus / top-k truncation, its own seed stream
    assert (val.n, val.temperature, val.top_p, val.top_k) == (2, 0.0, 1.0, -1)
    assert val.greedy and val.max_new_tokens == 48 and val.stop == ("\n\n",)
    assert val.seed == derive_seed("validate", 2, 5) != train.seed
    assert sampling_params(cfg, 48, 6, validation=False).seed != train.seed


def test_rollouts_table_rows_follow_the_completions() -> None:
    prompts = pa.table(
        {
            "index": [10, 11],
            "data_source": ["a", "b"],
            "ground_truth": ["1", "2"],
            "prompt_text": ["p0", "p1"],
        }
    )
    completions = [
        Completion(0, 0, [5, 6], [7, 8, 9], "x", [-0.1, -0.2, -0.3], "stop"),
        Completion(0, 1, [5, 6], [7], "y", [-0.5], "length"),
        Completion(1, 0, [4], [], "", [], "length"),
    ]
    t = rollouts_table(completions, prompts, iteration=3, policy_version=3).to_pydict()
    assert t["group_id"] == [0, 0, 1]
    assert t["sample_index"] == [0, 1, 0]
    assert t["prompt_index"] == [10, 10, 11]  # the dataset index, not the batch position
    assert t["data_source"] == ["a", "a", "b"] and t["ground_truth"] == ["1", "1", "2"]
    assert t["prompt_length"] == [2, 2, 1] and t["response_length"] == [3, 1, 0]
    assert t["iteration"] == [3, 3, 3] and t["policy_version"] == [3, 3, 3]
    assert t["finish_reason"] == ["stop", "length", "length"]
