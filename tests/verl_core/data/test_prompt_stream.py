"""The prompt stream (verl_core.data.prompt_stream): which rows a batch takes from a cursor, and the
cursor after it; one batch per iteration and dynamic sampling's several batches are the same stream."""

from __future__ import annotations

import pytest

from verl_core.data.prompt_stream import (
    StreamBatch,
    iteration_batch,
    iteration_cursor,
    next_cursor,
    stream_rows,
    take_batch,
)
from verl_core.errors import DataError


def test_one_batch_per_iteration_without_shuffle_by_hand() -> None:
    # n = 5 prompts, 3 per iteration: the stream is 0 1 2 3 4 | 0 1 2 3 4 | 0 1 2 3 4 | …
    #   iteration 0 → k = 0,1,2   → [0, 1, 2], first row in epoch 0, next cursor 3
    #   iteration 1 → k = 3,4,5   → [3, 4, 0], first row (k=3) in epoch 0, next cursor 6
    #   iteration 2 → k = 6,7,8   → [1, 2, 3], epoch 1, next cursor 9
    #   iteration 3 → k = 9,10,11 → [4, 0, 1], epoch 1 (k=9 is the last row of epoch 1), next 12
    #   iteration 4 → k = 12..14  → [2, 3, 4], epoch 2, next 15
    expected = [
        ([0, 1, 2], 0, 3),
        ([3, 4, 0], 0, 6),
        ([1, 2, 3], 1, 9),
        ([4, 0, 1], 1, 12),
        ([2, 3, 4], 2, 15),
    ]
    got = [iteration_batch(5, 3, it, seed=7, shuffle=False) for it in range(5)]
    assert got == [StreamBatch(*e) for e in expected]
    # iteration i starts at i·B, which is where iteration i − 1's batch ended
    assert [iteration_cursor(it, 3) for it in range(5)] == [0, 3, 6, 9, 12]
    assert all(iteration_cursor(it + 1, 3) == next_cursor(iteration_cursor(it, 3), 3) for it in range(5))


def test_a_batch_larger_than_the_prompt_set() -> None:
    # n = 3, batch 7: iteration 0 is k = 0..6 → 0 1 2 | 0 1 2 | 0
    #                 iteration 1 is k = 7..13 → 1 2 | 0 1 2 | 0 1, k=7 is in epoch 7 // 3 = 2
    assert iteration_batch(3, 7, 0, seed=0, shuffle=False) == ([0, 1, 2, 0, 1, 2, 0], 0, 7)
    assert iteration_batch(3, 7, 1, seed=0, shuffle=False) == ([1, 2, 0, 1, 2, 0, 1], 2, 14)


def test_shuffle_is_a_permutation_per_epoch_and_deterministic() -> None:
    n, b = 10, 4
    # 10 iterations × 4 rows = 40 rows = exactly 4 epochs of 10
    stream = [r for it in range(10) for r in iteration_batch(n, b, it, seed=3, shuffle=True).rows]
    epochs = [stream[e * n : (e + 1) * n] for e in range(4)]
    for perm in epochs:
        assert sorted(perm) == list(range(n))  # every prompt exactly once per epoch
    assert len({tuple(p) for p in epochs}) > 1  # reshuffled between epochs
    assert epochs[0] != list(range(n))
    # same (seed, iteration) → same rows, whatever was asked before (a resumed run)
    again = iteration_batch(n, b, 7, seed=3, shuffle=True)
    assert again == iteration_batch(n, b, 7, seed=3, shuffle=True)
    assert again.rows == stream[28:32] and again.epoch == 2  # k = 28 → epoch 28 // 10 = 2
    # another seed, another order
    other = [r for it in range(3) for r in iteration_batch(n, b, it, seed=4, shuffle=True).rows]
    assert other[:n] != epochs[0]


def test_wrap_around_at_an_epoch_end_joins_two_permutations() -> None:
    # n = 4, shuffled: a batch of 4 from cursor 2 is k = 2, 3 (the end of epoch 0's permutation)
    # then k = 4, 5 (the start of epoch 1's): perm_0[2], perm_0[3], perm_1[0], perm_1[1]
    perm0, e0 = stream_rows(4, 0, 4, seed=5, shuffle=True)
    perm1, e1 = stream_rows(4, 4, 4, seed=5, shuffle=True)
    assert (e0, e1) == (0, 1) and sorted(perm0) == sorted(perm1) == [0, 1, 2, 3]
    batch = take_batch(4, 2, 4, seed=5, shuffle=True)
    assert batch == ([perm0[2], perm0[3], perm1[0], perm1[1]], 0, 6)  # epoch of its first row: 2 // 4 = 0


def test_a_cursor_mid_batch_by_hand() -> None:
    # n = 5, no shuffle, B = 3; dynamic sampling left the cursor at 4 (not a multiple of B):
    # k = 4, 5, 6 → 4 | 0 1, first row in epoch 0, next cursor 7;
    # then k = 7, 8, 9 → 2 3 4, epoch 7 // 5 = 1, next cursor 10
    assert take_batch(5, 4, 3, seed=7, shuffle=False) == ([4, 0, 1], 0, 7)
    assert take_batch(5, 7, 3, seed=7, shuffle=False) == ([2, 3, 4], 1, 10)
    assert stream_rows(5, 4, 3, seed=7, shuffle=False) == ([4, 0, 1], 0)


def test_dynamic_sampling_taking_two_batches_moves_the_next_iteration_on() -> None:
    # n = 5, no shuffle, B = 2. Iteration 0 takes two generation batches: cursor 0 → k = 0, 1 → [0, 1],
    # then cursor 2 → k = 2, 3 → [2, 3]; the cursor is then 4, so iteration 1's first batch is
    # k = 4, 5 → [4, 0] (epoch 0), where one batch per iteration would have taken k = 2, 3 again
    first = take_batch(5, 0, 2, seed=1, shuffle=False)
    second = take_batch(5, first.next_cursor, 2, seed=1, shuffle=False)
    assert (first, second) == (([0, 1], 0, 2), ([2, 3], 0, 4))
    assert take_batch(5, second.next_cursor, 2, seed=1, shuffle=False) == ([4, 0], 0, 6)
    assert iteration_batch(5, 2, 1, seed=1, shuffle=False).rows == [2, 3]
    # shuffled, the two batches are the stream's positions 0..3, as two one-batch iterations take them
    a = take_batch(10, 0, 2, seed=9, shuffle=True)
    b = take_batch(10, a.next_cursor, 2, seed=9, shuffle=True)
    one_batch = [r for it in range(2) for r in iteration_batch(10, 2, it, seed=9, shuffle=True).rows]
    assert a.rows + b.rows == one_batch == stream_rows(10, 0, 4, seed=9, shuffle=True)[0]


def test_an_empty_prompt_set_is_refused() -> None:
    with pytest.raises(DataError, match="empty"):
        iteration_batch(0, 3, 0, seed=0, shuffle=True)
