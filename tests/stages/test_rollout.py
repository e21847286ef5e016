"""Rollout stage helpers: the deterministic batch loader across epochs, sampling parameters for
training vs validation, the rollouts table."""

from __future__ import annotations

import pyarrow as pa
import pytest

from stages.floor.artifacts import batch_rows, rollouts_table, stream_rows
from stages.floor.rollouts import sampling_params
from verl_core.config import RolloutConfig
from verl_core.errors import DataError
from verl_core.rollout import Completion
from verl_core.seeding import derive_seed


def test_batch_rows_without_shuffle_by_hand() -> None:
    # n = 5 prompts, 3 per iteration: the stream is 0 1 2 3 4 | 0 1 2 3 4 | 0 1 2 3 4 | …
    #   iteration 0 → k = 0,1,2   → [0, 1, 2], first row in epoch 0
    #   iteration 1 → k = 3,4,5   → [3, 4, 0], first row (k=3) in epoch 0
    #   iteration 2 → k = 6,7,8   → [1, 2, 3], epoch 1
    #   iteration 3 → k = 9,10,11 → [4, 0, 1], epoch 1 (k=9 is the last row of epoch 1)
    #   iteration 4 → k = 12..14  → [2, 3, 4], epoch 2
    expected = [([0, 1, 2], 0), ([3, 4, 0], 0), ([1, 2, 3], 1), ([4, 0, 1], 1), ([2, 3, 4], 2)]
    got = [batch_rows(5, 3, it, seed=7, shuffle=False) for it in range(5)]
    assert got == expected


def test_batch_rows_batch_larger_than_the_prompt_set() -> None:
    # n = 3, batch 7: iteration 0 is k = 0..6 → 0 1 2 | 0 1 2 | 0
    #                 iteration 1 is k = 7..13 → 1 2 | 0 1 2 | 0 1
    assert batch_rows(3, 7, 0, seed=0, shuffle=False) == ([0, 1, 2, 0, 1, 2, 0], 0)
    assert batch_rows(3, 7, 1, seed=0, shuffle=False) == ([1, 2, 0, 1, 2, 0, 1], 2)  # k=7 is in epoch 2


def test_batch_rows_with_shuffle_is_a_permutation_per_epoch_and_deterministic() -> None:
    n, b = 10, 4
    # 10 iterations × 4 rows = 40 rows = exactly 4 epochs of 10
    stream = [r for it in range(10) for r in batch_rows(n, b, it, seed=3, shuffle=True)[0]]
    epochs = [stream[e * n : (e + 1) * n] for e in range(4)]
    for perm in epochs:
        assert sorted(perm) == list(range(n))  # every prompt exactly once per epoch
    assert len({tuple(p) for p in epochs}) > 1  # reshuffled between epochs
    assert epochs[0] != list(range(n))
    # same (seed, iteration) → same rows, whatever was asked before (a resumed run)
    assert batch_rows(n, b, 7, seed=3, shuffle=True) == batch_rows(n, b, 7, seed=3, shuffle=True)
    assert batch_rows(n, b, 7, seed=3, shuffle=True)[0] == stream[28:32]
    assert batch_rows(n, b, 7, seed=3, shuffle=True)[1] == 2  # k = 28 → epoch 2
    # another seed, another order
    other = [r for it in range(3) for r in batch_rows(n, b, it, seed=4, shuffle=True)[0]]
    assert other[:n] != epochs[0]


def test_stream_rows_from_a_cursor_by_hand() -> None:
    # n = 5, no shuffle: the stream is 0 1 2 3 4 | 0 1 2 3 4 | …; dynamic sampling takes 3 rows
    # from cursor 4 (k = 4, 5, 6 → 4 | 0 1, first row in epoch 0),
    # then from cursor 7 (k = 7, 8, 9 → 2 3 4, epoch 1)
    assert stream_rows(5, 4, 3, seed=7, shuffle=False) == ([4, 0, 1], 0)
    assert stream_rows(5, 7, 3, seed=7, shuffle=False) == ([2, 3, 4], 1)
    # one batch per iteration is the stream from cursor iteration·B (the same definition)
    for it in range(6):
        assert batch_rows(10, 4, it, seed=3, shuffle=True) == stream_rows(10, 4 * it, 4, seed=3, shuffle=True)


def test_batch_rows_empty_prompt_set() -> None:
    with pytest.raises(DataError, match="empty"):
        batch_rows(0, 3, 0, seed=0, shuffle=True)


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
