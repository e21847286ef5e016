"""Advantage estimators: hand-worked examples, and the vectorised code against plain loops."""

import math
import statistics

import pytest
import torch

from verl_core.algorithms import (
    ADV_ESTIMATORS,
    get_adv_estimator,
    group_ids,
    scores_to_token_rewards,
)

F64 = torch.float64


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------


def test_scores_land_on_last_valid_token() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    rewards = scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    # row 1 has no valid token, so its score is dropped.
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 3.0]]))


def test_group_ids_from_tensor_and_hashables_partition_alike() -> None:
    from_tensor = group_ids(torch.tensor([7, 3, 7, 5]))
    from_strings = group_ids(["x", "y", "x", "z"])
    # Same partition {0, 2}, {1}, {3}: equal ids exactly where the inputs are equal.
    same_t = from_tensor[:, None] == from_tensor[None, :]
    same_s = from_strings[:, None] == from_strings[None, :]
    assert torch.equal(same_t, same_s)
    assert from_strings.tolist() == [0, 1, 0, 2]


# ---------------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------------


def test_gae_hand_example() -> None:
    # γ = λ = 0.5, so γλ = 0.25.
    # row 0, mask 1 1 1, r = 0 0 1, V = 0.5 0.25 0.5:
    #   t2: δ = 1 − 0.5 = 0.5,              A2 = 0.5
    #   t1: δ = 0 + 0.5·0.5 − 0.25 = 0,     A1 = 0 + 0.25·0.5 = 0.125
    #   t0: δ = 0 + 0.5·0.25 − 0.5 = −0.375, A0 = −0.375 + 0.25·0.125 = −0.34375
    #   returns = A + V = 0.15625 0.375 1.0
    # row 1, mask 1 0 1 (a hole: t1 is skipped, its reward 5 and value 9 ignored), r = 0 5 2, V = 1 9 0.5:
    #   t2: δ = 2 − 0.5 = 1.5, A2 = 1.5;  t0: δ = 0 + 0.5·0.5 − 1 = −0.75, A0 = −0.75 + 0.25·1.5 = −0.375
    #   returns = 0.625 0 2.0
    # row 2, mask 1 1 0 (right padding), r = 0 1 0, V = 0.25 0.5 7:
    #   t1: δ = 1 − 0.5 = 0.5, A1 = 0.5;  t0: δ = 0.5·0.5 − 0.25 = 0, A0 = 0.25·0.5 = 0.125
    #   returns = 0.375 1.0 0
    rewards = _t([[0, 0, 1], [0, 5, 2], [0, 1, 0]])
    values = _t([[0.5, 0.25, 0.5], [1, 9, 0.5], [0.25, 0.5, 7]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 0]])
    out = get_adv_estimator("gae")(
        token_level_rewards=rewards, response_mask=mask, values=values, gamma=0.5, lam=0.5
    )
    torch.testing.assert_close(out.returns, _t([[0.15625, 0.375, 1.0], [0.625, 0, 2.0], [0.375, 1.0, 0]]))
    # Advantages are the raw A above, whitened over the 7 valid entries (mean/unbiased std of that list).
    raw = [-0.34375, 0.125, 0.5, -0.375, 1.5, 0.125, 0.5]
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    w = [(a - mean) / std for a in raw]
    expected = _t([[w[0], w[1], w[2]], [w[3], 0, w[4]], [w[5], w[6], 0]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-7, rtol=0)


def _gae_loop(
    rewards: list[list[float]], values: list[list[float]], mask: list[list[int]], gamma: float, lam: float
) -> tuple[list[list[float]], list[list[float]]]:
    """Readable GAE: for each row, run the textbook recursion over its valid positions only."""
    advantages = [[0.0] * len(row) for row in rewards]
    returns = [[0.0] * len(row) for row in rewards]
    for i in range(len(rewards)):
        valid = [t for t in range(len(rewards[i])) if mask[i][t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(valid):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[i][t]
            advantages[i][t] = next_adv
            returns[i][t] = next_adv + values[i][t]
    flat = [advantages[i][t] for i in range(len(mask)) for t in range(len(mask[i])) if mask[i][t]]
    mean, var = statistics.mean(flat), statistics.variance(flat)
    whitened = [
        [(a - mean) / math.sqrt(var + 1e-8) if m else 0.0 for a, m in zip(row, mrow, strict=True)]
        for row, mrow in zip(advantages, mask, strict=True)
    ]
    return whitened, returns


def test_gae_matches_double_loop_on_random_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 9, generator=gen, dtype=F64)
    values = torch.randn(5, 9, generator=gen, dtype=F64)
    mask = (torch.rand(5, 9, generator=gen) < 0.7).long()  # random holes and padding
    mask[:, 0] = 1
    out = get_adv_estimator("gae")(
        token_level_rewards=rewards, response_mask=mask, values=values, gamma=0.9, lam=0.8
    )
    adv_ref, ret_ref = _gae_loop(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.8)
    torch.testing.assert_close(out.advantages, _t(adv_ref))
    torch.testing.assert_close(out.returns, _t(ret_ref))


# ---------------------------------------------------------------------------------------------------
# GRPO / Dr.GRPO / RLOO
# ---------------------------------------------------------------------------------------------------

# Six responses, ragged masks; the score is the sum of the token rewards (row 0 splits its 1 over two
# tokens). Groups: a = rows 0-2 (scores 1, 0, 2), b = rows 3-4 (scores 3, 1), c = row 5 (score 5).
GROUP_REWARDS = _t([[0.5, 0.5, 0], [0, 0, 0], [0, 2, 0], [0, 0, 3], [1, 0, 0], [0, 5, 0]])
GROUP_MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
GROUP_INDEX = ["a", "a", "a", "b", "b", "c"]


def test_grpo_hand_example() -> None:
    # a: mean 1, unbiased std sqrt((0 + 1 + 1)/2) = 1 -> A = 0, −1, 1
    # b: mean 2, std sqrt((1 + 1)/1) = √2     -> A = 1/√2 = 0.707107, −0.707107
    # c: a group of one: mean 0, std 1          -> A = 5
    out = get_adv_estimator("grpo")(
        token_level_rewards=GROUP_REWARDS, response_mask=GROUP_MASK, index=GROUP_INDEX, epsilon=0.0
    )
    per_seq = [0.0, -1.0, 1.0, 0.707107, -0.707107, 5.0]
    expected = _t([[a] * 3 for a in per_seq]) * GROUP_MASK
    torch.testing.assert_close(out.advantages, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.returns, out.advantages)


def test_dr_grpo_drops_the_std() -> None:
    # A = r − mean: a: 0, −1, 1; b: 1, −1; c: 5 − 0 = 5.
    out = get_adv_estimator("grpo")(
        token_level_rewards=GROUP_REWARDS,
        response_mask=GROUP_MASK,
        index=GROUP_INDEX,
        norm_adv_by_std_in_grpo=False,
    )
    per_seq = [0.0, -1.0, 1.0, 1.0, -1.0, 5.0]
    torch.testing.assert_close(out.advantages, _t([[a] * 3 for a in per_seq]) * GROUP_MASK)


def test_rloo_hand_example() -> None:
    # A_i = r_i − mean of the others. a (1, 0, 2): 1 − 1 = 0, 0 − 1.5 = −1.5, 2 − 0.5 = 1.5;
    # b (3, 1): 3 − 1 = 2, 1 − 3 = −2; c (5) alone: 5.
    out = get_adv_estimator("rloo")(
        token_level_rewards=GROUP_REWARDS, response_mask=GROUP_MASK, index=GROUP_INDEX
    )
    per_seq = [0.0, -1.5, 1.5, 2.0, -2.0, 5.0]
    torch.testing.assert_close(out.advantages, _t([[a] * 3 for a in per_seq]) * GROUP_MASK)


def _random_groups(seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 5]
    index = [g for g, n in enumerate(sizes) for _ in range(n)]
    perm = torch.randperm(len(index), generator=gen).tolist()
    index = [index[p] * 10 + 3 for p in perm]  # shuffled, non-dense ids
    mask = (torch.rand(len(index), 6, generator=gen) < 0.8).long()
    mask[:, 0] = 1
    rewards = torch.randn(len(index), 6, generator=gen, dtype=F64) * mask
    return rewards, mask, index


def test_grpo_and_rloo_match_per_group_loops() -> None:
    rewards, mask, index = _random_groups(seed=3)
    scores = rewards.sum(-1).tolist()
    grpo_ref, rloo_ref = [], []
    for i, g in enumerate(index):
        group = [scores[j] for j in range(len(index)) if index[j] == g]
        if len(group) == 1:
            grpo_ref.append(scores[i] / (1 + 1e-6))
            rloo_ref.append(scores[i])
            continue
        grpo_ref.append((scores[i] - statistics.mean(group)) / (statistics.stdev(group) + 1e-6))
        rloo_ref.append(scores[i] - (sum(group) - scores[i]) / (len(group) - 1))
    ids = torch.tensor(index)
    grpo = get_adv_estimator("grpo")(token_level_rewards=rewards, response_mask=mask, index=ids)
    rloo = get_adv_estimator("rloo")(token_level_rewards=rewards, response_mask=mask, index=ids)
    torch.testing.assert_close(grpo.advantages, _t(grpo_ref)[:, None] * mask)
    torch.testing.assert_close(rloo.advantages, _t(rloo_ref)[:, None] * mask)


# ---------------------------------------------------------------------------------------------------
# REINFORCE++ / REINFORCE++-baseline / ReMax
# ---------------------------------------------------------------------------------------------------


def test_reinforce_plus_plus_hand_example() -> None:
    # γ = 0.5. row 0, mask 1 1 1, r = 1 0 2: G2 = 2, G1 = 0 + 0.5·2 = 1, G0 = 1 + 0.5·1 = 1.5.
    # row 1, mask 1 1 0, r = 0 4 9: the 9 sits past EOS and is reset away: G1 = 4, G0 = 0.5·4 = 2.
    # whiten(1.5, 1, 2, 2, 4): mean 2.1, unbiased var 5.2/4 = 1.3, std 1.140175:
    #   −0.526235, −0.964764, −0.087706, −0.087706, 1.666410
    rewards = _t([[1, 0, 2], [0, 4, 9]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = get_adv_estimator("reinforce_plus_plus")(token_level_rewards=rewards, response_mask=mask, gamma=0.5)
    torch.testing.assert_close(out.returns, _t([[1.5, 1, 2], [2, 4, 0]]))
    expected = _t([[-0.526235, -0.964764, -0.087706], [-0.087706, 1.666410, 0]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-6, rtol=0)


def test_reinforce_plus_plus_baseline_hand_example() -> None:
    # scores 1, 3 (group 0, mean 2) and 2 (group 1, alone, mean 0): centred −1, 1, 2.
    # tokens: row 0 (2 valid) −1 −1, row 1 (1 valid) 1, row 2 (3 valid) 2 2 2.
    # whiten(−1, −1, 1, 2, 2, 2): mean 5/6, Σ dev² = 2·(11/6)² + (1/6)² + 3·(7/6)² = 65/6,
    #   unbiased var 13/6, std 1.471960: −1.245505, 0.113228, 0.792594.
    rewards = _t([[0, 1, 0], [3, 0, 0], [0, 0, 2]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    out = get_adv_estimator("reinforce_plus_plus_baseline")(
        token_level_rewards=rewards, response_mask=mask, index=torch.tensor([0, 0, 1])
    )
    expected = _t([[-1.245505, -1.245505, 0], [0.113228, 0, 0], [0.792594] * 3])
    torch.testing.assert_close(out.advantages, expected, atol=1e-6, rtol=0)


def test_remax_hand_example() -> None:
    # row 0: r = 0 1 2 -> returns 3 3 2; greedy 1.5 -> A = 1.5 1.5 0.5.
    # row 1: mask 1 1 0, r = 1 0 7 (7 is padding) -> returns 1 0 0; greedy 2 -> A = −1 −2 0.
    rewards = _t([[0, 1, 2], [1, 0, 7]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = get_adv_estimator("remax")(
        token_level_rewards=rewards, response_mask=mask, greedy_rewards=_t([[1.5, 2]])[0]
    )
    torch.testing.assert_close(out.returns, _t([[3, 3, 2], [1, 0, 0]]))
    torch.testing.assert_close(out.advantages, _t([[1.5, 1.5, 0.5], [-1, -2, 0]]))


# ---------------------------------------------------------------------------------------------------
# Shared signature and errors
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ADV_ESTIMATORS)
def test_every_estimator_takes_the_shared_kwargs(name: str) -> None:
    rewards, mask, index = _random_groups(seed=5)
    values = torch.randn(rewards.shape, generator=torch.Generator().manual_seed(6), dtype=F64)
    out = get_adv_estimator(name)(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        values=values,
        greedy_rewards=torch.zeros(rewards.shape[0], dtype=F64),
        gamma=0.99,
        lam=0.95,
        norm_adv_by_std_in_grpo=True,
        epsilon=1e-6,
    )
    assert out.advantages.shape == out.returns.shape == rewards.shape
    assert not out.advantages.requires_grad
    assert (out.advantages[mask == 0] == 0).all() and (out.returns[mask == 0] == 0).all()
    assert out.advantages[mask == 1].abs().sum() > 0


@pytest.mark.parametrize(
    ("name", "missing"),
    [("gae", "values"), ("grpo", "index"), ("rloo", "index"), ("remax", "greedy_rewards")],
)
def test_missing_inputs_are_named(name: str, missing: str) -> None:
    with pytest.raises(ValueError, match=missing):
        get_adv_estimator(name)(token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3))


def test_index_length_must_match_batch() -> None:
    with pytest.raises(ValueError, match="index has 3 entries for a batch of 2"):
        get_adv_estimator("grpo")(
            token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3), index=[0, 0, 1]
        )
