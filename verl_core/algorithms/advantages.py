"""Advantage estimators, chosen by ``algorithm.adv_estimator``.

All estimators share one keyword-only signature (:class:`AdvantageEstimator`) and return
:class:`AdvantageOutput` ``(advantages (B, T), returns (B, T))``, both 0 outside ``response_mask``.
Arguments an estimator does not need are ignored. Outcome rewards (one score per response) are put on
the last valid response token with :func:`scores_to_token_rewards`; the outcome estimators (GRPO, RLOO,
REINFORCE++-baseline) sum the token rewards of a response back into its score.

The estimators are ``torch.no_grad``: advantages and returns are targets, never differentiated.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal, NamedTuple, Protocol, TypeAlias

import torch
from torch import Tensor

from verl_core.algorithms.stats import masked_sum, masked_whiten
from verl_core.registry import Registry

GroupIndex: TypeAlias = "Tensor | Sequence[Hashable]"
"""Prompt id of each response ``(B,)``: an int tensor, or any sequence of hashables (e.g. uid strings)."""


class AdvantageOutput(NamedTuple):
    """Result of an advantage estimator.

    Attributes:
        advantages: ``(B, T)`` per-token advantages, 0 outside the response mask.
        returns: ``(B, T)`` per-token return targets (for the critic in GAE), 0 outside the mask.
    """

    advantages: Tensor
    returns: Tensor


class AdvantageEstimator(Protocol):
    """The signature every registered advantage estimator has.

    Args:
        token_level_rewards: ``(B, T)`` reward per response token (already minus any in-reward KL).
        response_mask: ``(B, T)`` 1 on response tokens that count.
        index: ``(B,)`` prompt/group id of each response (GRPO, RLOO, REINFORCE++-baseline).
        values: ``(B, T)`` critic values V_t (GAE).
        greedy_rewards: ``(B,)`` reward of the greedy response to the same prompt (ReMax).
        gamma: discount γ (GAE, REINFORCE++).
        lam: GAE λ.
        norm_adv_by_std_in_grpo: GRPO divides by the group std; ``False`` gives Dr.GRPO.
        epsilon: added to the group std (GRPO).
    """

    def __call__(
        self,
        *,
        token_level_rewards: Tensor,
        response_mask: Tensor,
        index: GroupIndex | None = None,
        values: Tensor | None = None,
        greedy_rewards: Tensor | None = None,
        gamma: float = 1.0,
        lam: float = 1.0,
        norm_adv_by_std_in_grpo: bool = True,
        epsilon: float = 1e-6,
    ) -> AdvantageOutput: ...


ADV_ESTIMATOR_REGISTRY: Registry[AdvantageEstimator] = Registry("advantage estimator")

AdvEstimatorName = Literal[
    "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"
]


def get_adv_estimator(name: str) -> AdvantageEstimator:
    """The advantage estimator registered as ``name`` (raises, listing valid names, if unknown)."""
    return ADV_ESTIMATOR_REGISTRY.get(name)


# ---------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------


def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place one outcome score per response on its last valid response token.

    Args:
        scores: ``(B,)``.
        response_mask: ``(B, T)``.

    Returns:
        ``(B, T)`` on the mask's device, zeros except ``scores[i]`` at the last position where
        ``response_mask[i]`` is set (rows with an empty mask stay all zero).
    """
    mask = response_mask.to(torch.bool)
    scores = scores.to(mask.device)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)  # (B, T)
    last = torch.where(mask, positions, -1).max(dim=-1).values  # (B,), -1 for empty rows
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] = scores[rows]
    return rewards


def group_ids(index: GroupIndex, device: torch.device | None = None) -> Tensor:
    """Dense group ids ``(B,)`` int64 in ``[0, G)`` from prompt ids (tensor or sequence of hashables)."""
    if isinstance(index, Tensor):
        return torch.unique(index, return_inverse=True)[1].to(device=device, dtype=torch.int64)
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(key, len(dense)) for key in index]
    return torch.tensor(ids, dtype=torch.int64, device=device)


class GroupStats(NamedTuple):
    """Per-response statistics of its group, each ``(B,)``.

    A group of one has ``mean = 0`` and ``std = 1`` (verl's convention: its advantage is its score).
    """

    mean: Tensor
    std: Tensor
    size: Tensor


def group_stats(scores: Tensor, ids: Tensor) -> GroupStats:
    """Mean, unbiased std and size of each response's group.

    Args:
        scores: ``(B,)`` one score per response.
        ids: ``(B,)`` dense int64 group ids (:func:`group_ids`).
    """
    num_groups = int(ids.max()) + 1 if ids.numel() > 0 else 0
    count = torch.bincount(ids, minlength=num_groups).to(scores.dtype)  # (G,)
    total = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, scores)
    mean = total / count  # (G,)
    sq_dev = torch.zeros_like(total).index_add_(0, ids, (scores - mean[ids]) ** 2)
    # Unbiased std: sqrt(Σ (s − mean)² / (n − 1)), as torch.std.
    std = torch.sqrt(sq_dev / (count - 1).clamp_min(1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return GroupStats(mean=mean[ids], std=std[ids], size=count[ids])


def _as_float(tensor: Tensor) -> Tensor:
    """``tensor`` in float32, or float64 if it already is (half precision is too coarse for returns)."""
    return tensor if tensor.dtype == torch.float64 else tensor.to(torch.float32)


def _require(tensor: Tensor | None, what: str, estimator: str) -> Tensor:
    if tensor is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {what}")
    return tensor


def _require_index(index: GroupIndex | None, batch: int, estimator: str) -> GroupIndex:
    if index is None:
        raise ValueError(f"advantage estimator {estimator!r} needs index (B,) group ids")
    if len(index) != batch:
        raise ValueError(f"index has {len(index)} entries for a batch of {batch}")
    return index


# ---------------------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------------------


@ADV_ESTIMATOR_REGISTRY.register("gae")
@torch.no_grad()
def compute_gae_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    greedy_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> AdvantageOutput:
    """Generalised advantage estimation (Schulman et al. 2015, eq. 16); uses ``values``, ``gamma``, ``lam``.

    Positions where the mask is 0 are skipped: V_{t+1} and A_{t+1} are those of the next *valid*
    token, and the value after the last valid token is 0. ``returns = A + V`` (before whitening);
    ``advantages`` are whitened over the mask.
    """
    v = _as_float(_require(values, "values (B, T)", "gae"))
    mask = response_mask.to(v.dtype)
    rewards = token_level_rewards.to(v.dtype)
    next_value = torch.zeros_like(v[:, 0])  # (B,) V of the next valid token
    next_adv = torch.zeros_like(v[:, 0])  # (B,) A of the next valid token
    reversed_advs = []
    for t in reversed(range(v.shape[1])):
        # δ_t = r_t + γ V_{t+1} − V_t;  A_t = δ_t + γλ A_{t+1}
        delta = rewards[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * next_adv
        m = mask[:, t]
        next_value = m * v[:, t] + (1 - m) * next_value
        next_adv = m * adv_t + (1 - m) * next_adv
        reversed_advs.append(adv_t)
    advantages = torch.stack(reversed_advs[::-1], dim=1)  # (B, T)
    returns = (advantages + v) * mask
    return AdvantageOutput(advantages=masked_whiten(advantages, mask), returns=returns)


@ADV_ESTIMATOR_REGISTRY.register("grpo")
@torch.no_grad()
def compute_grpo_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    greedy_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> AdvantageOutput:
    """GRPO group-relative advantage (Shao et al. 2024, §4.1.2); uses ``index``, ``epsilon``.

    A_i = (r_i − mean_g) / (std_g + ε) with the unbiased std over the group g of responses to the same
    prompt; ``norm_adv_by_std_in_grpo=False`` gives Dr.GRPO's A_i = r_i − mean_g (Liu et al. 2025, §3.2).
    r_i is the sum of the token rewards of response i; A_i is broadcast to all its tokens.
    ``returns == advantages``.
    """
    rewards = _as_float(token_level_rewards)
    mask = response_mask.to(rewards.dtype)
    scores = masked_sum(rewards, mask, dim=-1)  # (B,)
    ids = group_ids(_require_index(index, scores.shape[0], "grpo"), scores.device)
    stats = group_stats(scores, ids)
    adv = scores - stats.mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (stats.std + epsilon)
    advantages = adv[:, None] * mask
    return AdvantageOutput(advantages=advantages, returns=advantages)


@ADV_ESTIMATOR_REGISTRY.register("rloo")
@torch.no_grad()
def compute_rloo_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    greedy_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> AdvantageOutput:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, eq. 6); uses ``index``.

    A_i = r_i − 1/(n−1) Σ_{j≠i} r_j = n/(n−1) · (r_i − mean_g) for a group of n > 1;
    a group of one gets A_i = r_i. ``returns == advantages``.
    """
    rewards = _as_float(token_level_rewards)
    mask = response_mask.to(rewards.dtype)
    scores = masked_sum(rewards, mask, dim=-1)  # (B,)
    ids = group_ids(_require_index(index, scores.shape[0], "rloo"), scores.device)
    stats = group_stats(scores, ids)
    n = stats.size
    scale = torch.where(n > 1, n / (n - 1).clamp_min(1), torch.ones_like(n))
    advantages = (scale * (scores - stats.mean))[:, None] * mask
    return AdvantageOutput(advantages=advantages, returns=advantages)


@ADV_ESTIMATOR_REGISTRY.register("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    greedy_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, §3): whitened discounted return; uses ``gamma``.

    G_t = r_t + γ G_{t+1}, computed backwards; the running return is reset to 0 at every masked-out
    position (so nothing leaks backwards from padding past EOS). ``returns = G`` and
    ``advantages = whiten(G)`` over the mask (the batch-wide normalisation of the paper).
    """
    rewards = _as_float(token_level_rewards)
    mask = response_mask.to(rewards.dtype)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    reversed_returns = []
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        reversed_returns.append(running)
        running = running * mask[:, t]
    returns = torch.stack(reversed_returns[::-1], dim=1) * mask  # (B, T)
    return AdvantageOutput(advantages=masked_whiten(returns, mask), returns=returns)


@ADV_ESTIMATOR_REGISTRY.register("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    greedy_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> AdvantageOutput:
    """REINFORCE++ with a group-mean baseline (Hu 2025, §3.2); uses ``index``.

    A = whiten(r_i − mean_g) over all masked tokens of the batch (a group of one has mean 0).
    ``returns == advantages``.
    """
    rewards = _as_float(token_level_rewards)
    mask = response_mask.to(rewards.dtype)
    scores = masked_sum(rewards, mask, dim=-1)  # (B,)
    ids = group_ids(_require_index(index, scores.shape[0], "reinforce_plus_plus_baseline"), scores.device)
    centred = (scores - group_stats(scores, ids).mean)[:, None] * mask  # (B, T)
    advantages = masked_whiten(centred, mask)
    return AdvantageOutput(advantages=advantages, returns=advantages)


@ADV_ESTIMATOR_REGISTRY.register("remax")
@torch.no_grad()
def compute_remax_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    greedy_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> AdvantageOutput:
    """ReMax (Li et al. 2023, Algorithm 1): return minus the greedy reward; uses ``greedy_rewards``.

    G_t = Σ_{t' ≥ t} r_t' (undiscounted, as in verl); A_t = G_t − r(greedy). ``returns = G``.
    """
    rewards = _as_float(token_level_rewards)
    baseline = _require(greedy_rewards, "greedy_rewards (B,)", "remax").to(rewards.dtype)
    mask = response_mask.to(rewards.dtype)
    rewards = rewards * mask
    returns = rewards.flip(-1).cumsum(-1).flip(-1) * mask  # (B, T) reverse cumulative sum
    advantages = (returns - baseline[:, None]) * mask
    return AdvantageOutput(advantages=advantages, returns=returns)


ADV_ESTIMATORS: tuple[str, ...] = ADV_ESTIMATOR_REGISTRY.names()
