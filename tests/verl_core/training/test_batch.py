"""RolloutBatch.from_tables: the update's batch built from the rollouts and rewards tables (stored
schema or not), the greedy baselines set apart per group, misaligned or malformed tables refused."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from tests.verl_core.training.test_ppo_iteration import GROUPS, PROMPTS, RESPONSES, SCORES, make_batch
from verl_core.training.batch import RolloutBatch


def tables(baseline: list[bool] | None = None) -> tuple[pa.Table, pa.Table]:
    n = len(PROMPTS)
    rollouts = {
        "group_id": pa.array(GROUPS, pa.int64()),
        "sample_index": pa.array([0, 1] * 3, pa.int32()),
        "prompt_ids": PROMPTS,
        "response_ids": RESPONSES,
        "logprobs": [[-0.5] * len(r) for r in RESPONSES],
    }
    if baseline is not None:
        rollouts["is_baseline"] = baseline
    rewards = {
        "group_id": pa.array(GROUPS, pa.int64()),
        "sample_index": pa.array([0, 1] * 3, pa.int32()),
        "score": pa.array(SCORES[:n], pa.float32()),
    }
    return pa.table(rollouts), pa.table(rewards)


def test_rollout_batch_from_tables() -> None:
    batch = RolloutBatch.from_tables(*tables())
    assert len(batch) == 6 and batch.baseline_scores is None
    assert batch.group_ids.tolist() == GROUPS and batch.scores.tolist() == SCORES
    assert batch.lengths == [5, 3, 5, 7, 2, 3]
    assert batch.behaviour_log_probs is not None
    assert batch.behaviour_log_probs[0].tolist() == [-0.5, -0.5, -0.5, 0.0]
    assert batch.response_mask[1].tolist() == [1.0, 0.0, 0.0, 0.0]
    # tables not yet conformed to the stored schema (int64 where the artifact has int32) still match
    rollouts, rewards = tables()
    wide = rewards.set_column(1, "sample_index", pa.array([0, 1] * 3, pa.int64()))
    assert len(RolloutBatch.from_tables(rollouts, wide)) == 6


def test_rollout_batch_sets_baseline_rows_apart() -> None:
    # the rollout stage's layout: the samples, then one greedy baseline per group at the end (here
    # groups 2, 0, 1 in that order, with distinct scores 0.25, 0.75, 0.5, so any mix-up shows)
    rollouts, rewards = tables()
    extra_r = pa.table(
        {
            "group_id": pa.array([2, 0, 1], pa.int64()),
            "sample_index": pa.array([2, 2, 2], pa.int32()),
            "prompt_ids": [PROMPTS[4], PROMPTS[0], PROMPTS[2]],
            "response_ids": [[30], [31, 32], [33]],
            "logprobs": [[-0.1], [-0.1, -0.1], [-0.1]],
        }
    )
    extra_w = pa.table(
        {
            "group_id": pa.array([2, 0, 1], pa.int64()),
            "sample_index": pa.array([2, 2, 2], pa.int32()),
            "score": pa.array([0.25, 0.75, 0.5], pa.float32()),
        }
    )
    flags = pa.array([False] * 6 + [True] * 3)
    both = pa.concat_tables([rollouts, extra_r]).append_column("is_baseline", flags)
    batch = RolloutBatch.from_tables(both, pa.concat_tables([rewards, extra_w]))
    assert len(batch) == 6 and batch.response_ids == RESPONSES and batch.scores.tolist() == SCORES
    # each sample gets its own group's greedy score: groups 0, 0, 1, 1, 2, 2
    assert batch.baseline_scores is not None
    assert batch.baseline_scores.tolist() == [0.75, 0.75, 0.5, 0.5, 0.25, 0.25]
    # a group without its baseline, or with two, is refused
    with pytest.raises(ValueError, match=r"no baseline \(is_baseline\) row for prompt group\(s\) \[1\]"):
        RolloutBatch.from_tables(*tables([False, True, False, False, False, True]))
    with pytest.raises(ValueError, match="prompt group 0 has more than one baseline"):
        RolloutBatch.from_tables(*tables([True, True, False, True, False, True]))


def test_rollout_batch_refuses_misaligned_or_malformed_tables() -> None:
    rollouts, rewards = tables()
    swapped = rewards.set_column(0, "group_id", pa.array([1, 0, 0, 1, 2, 2], pa.int64()))
    with pytest.raises(ValueError, match="column 'group_id' differs"):
        RolloutBatch.from_tables(rollouts, swapped)
    with pytest.raises(ValueError, match="6 rollouts for 5 rewards"):
        RolloutBatch.from_tables(rollouts, rewards.slice(0, 5))
    short = rollouts.set_column(4, "logprobs", pa.array([[-0.5]] * 6))
    with pytest.raises(ValueError, match="rollout row 0: 1 logprobs for 3 response tokens"):
        RolloutBatch.from_tables(short, rewards)
    with pytest.raises(ValueError, match="scores has 2 rows for 6 prompts"):
        make_batch(scores=torch.tensor([1.0, 0.0]))
