"""RL algorithms for LLM post-training: advantages, policy/value losses, KL, loss aggregation.

Pure torch functions: tensors and plain values in, ``(value, stats)`` NamedTuples out; padded
``(B, T)`` tensors with a mask (use :func:`pad_packed` / :func:`pack_padded` for packed ``(N,)`` data).
Variants are chosen by the names verl users know, through registries whose ``get`` lists the valid names::

    from verl_core.algorithms import get_adv_estimator, get_policy_loss, aggregate_loss

    adv = get_adv_estimator("grpo")(token_level_rewards=r, response_mask=m, index=uids)
    loss, stats = get_policy_loss("vanilla")(log_prob=lp, old_log_prob=old, advantages=adv.advantages,
                                              response_mask=m, loss_agg_mode="token-mean")

Registered names and their papers
---------------------------------

=================================== ==================================================================
name (config key)                   reference
=================================== ==================================================================
``gae`` (adv_estimator)             Schulman et al. 2015, "High-Dimensional Continuous Control Using
                                    Generalized Advantage Estimation"
``grpo`` (adv_estimator)            Shao et al. 2024, "DeepSeekMath" (GRPO)
``grpo`` + norm_adv_by_std=False    Liu et al. 2025, "Understanding R1-Zero-Like Training" (Dr.GRPO)
``rloo`` (adv_estimator)            Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE ..."
``reinforce_plus_plus``             Hu 2025, "REINFORCE++"
``reinforce_plus_plus_baseline``    Hu 2025, "REINFORCE++" (group-mean baseline variant)
``remax`` (adv_estimator)           Li et al. 2023, "ReMax"
``vanilla`` (policy_loss)           Schulman et al. 2017, "Proximal Policy Optimization Algorithms";
                                    clip-higher (clip_ratio_low ≠ clip_ratio_high): Yu et al. 2025,
                                    "DAPO"; dual clip (clip_ratio_c): Ye et al. 2020, "Mastering
                                    Complex Control in MOBA Games with Deep RL"
``gspo`` (policy_loss)              Zheng et al. 2025, "Group Sequence Policy Optimization"
``kl``, ``mse``, ``low_var_kl``     Schulman 2020, "Approximating KL divergence" (k1, k2, k3)
``abs``, ``*+`` (kl estimators)     verl (|k1|; straight-through k2 gradient, after Schulman 2020)
``fixed``, ``adaptive`` (kl_ctrl)   Ziegler et al. 2019, "Fine-Tuning Language Models from Human
                                    Preferences", §2.2
``token-mean`` (loss_agg_mode)      Yu et al. 2025, "DAPO" (token-level policy gradient loss)
``seq-mean-token-mean``             Shao et al. 2024 (original GRPO objective)
``seq-mean-token-sum-norm``         Liu et al. 2025 (Dr.GRPO)
``token``/``sequence`` (rollout_is) Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
                                    Off-Policy RL Training" (TIS)
``geometric`` (rollout_rs, + above) Liu, Li et al. 2025, "When Speed Kills Stability" (MIS / RS)
=================================== ==================================================================

Modules: :mod:`.stats` (masked statistics, pack/pad), :mod:`.advantages`, :mod:`.policy_loss`,
:mod:`.value_loss`, :mod:`.kl`, :mod:`.aggregation` (micro-batch-safe loss aggregation, entropy
bonus), :mod:`.rollout_correction` (rollout/trainer mismatch metrics, TIS weights, rejection);
the registries are :class:`verl_core.registry.Registry`.
"""

from verl_core.algorithms.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    ADV_ESTIMATORS,
    AdvantageEstimator,
    AdvantageOutput,
    AdvEstimatorName,
    GroupIndex,
    GroupStats,
    get_adv_estimator,
    group_ids,
    group_stats,
    scores_to_token_rewards,
)
from verl_core.algorithms.aggregation import (
    LOSS_AGG_MODES,
    LOSS_AGG_REGISTRY,
    AggNorm,
    EntropyBonus,
    LossAggMode,
    agg_norm_for,
    aggregate_loss,
    entropy_bonus,
    entropy_from_logits,
)
from verl_core.algorithms.kl import (
    KL_CONTROLLER_REGISTRY,
    KL_CONTROLLERS,
    KL_ESTIMATOR_REGISTRY,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    KLControllerName,
    KLEstimator,
    KLEstimatorName,
    KLLossOutput,
    KLPenaltyOutput,
    KLPenaltyStats,
    apply_kl_penalty,
    compute_kl_loss,
    get_kl_controller,
    get_kl_estimator,
    make_kl_controller,
)
from verl_core.algorithms.policy_loss import (
    POLICY_LOSS_REGISTRY,
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossName,
    PolicyLossOutput,
    PolicyLossStats,
    get_policy_loss,
)
from verl_core.algorithms.rollout_correction import (
    WEIGHT_LEVEL_REGISTRY,
    WEIGHT_LEVELS,
    ISWeights,
    MismatchStats,
    Rejection,
    RolloutCorrection,
    RolloutISLevel,
    RolloutRSLevel,
    get_weight_level,
    mismatch_stats,
    rejection_mask,
    rollout_correction,
    truncated_is_weights,
)
from verl_core.algorithms.stats import (
    PaddedBatch,
    cu_seqlens_from_mask,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    pack_padded,
    pad_packed,
    seq_lengths,
)
from verl_core.algorithms.value_loss import (
    ValueLossOutput,
    ValueLossStats,
    compute_value_loss,
    explained_variance,
)
from verl_core.registry import Registry, UnknownNameError

__all__ = [
    "ADV_ESTIMATORS",
    "ADV_ESTIMATOR_REGISTRY",
    "KL_CONTROLLERS",
    "KL_CONTROLLER_REGISTRY",
    "KL_ESTIMATORS",
    "KL_ESTIMATOR_REGISTRY",
    "LOSS_AGG_MODES",
    "LOSS_AGG_REGISTRY",
    "POLICY_LOSSES",
    "POLICY_LOSS_REGISTRY",
    "WEIGHT_LEVELS",
    "WEIGHT_LEVEL_REGISTRY",
    "AdaptiveKLController",
    "AdvEstimatorName",
    "AdvantageEstimator",
    "AdvantageOutput",
    "AggNorm",
    "EntropyBonus",
    "FixedKLController",
    "GroupIndex",
    "GroupStats",
    "ISWeights",
    "KLController",
    "KLControllerName",
    "KLEstimator",
    "KLEstimatorName",
    "KLLossOutput",
    "KLPenaltyOutput",
    "KLPenaltyStats",
    "LossAggMode",
    "MismatchStats",
    "PaddedBatch",
    "PolicyLoss",
    "PolicyLossName",
    "PolicyLossOutput",
    "PolicyLossStats",
    "Registry",
    "Rejection",
    "RolloutCorrection",
    "RolloutISLevel",
    "RolloutRSLevel",
    "UnknownNameError",
    "ValueLossOutput",
    "ValueLossStats",
    "agg_norm_for",
    "aggregate_loss",
    "apply_kl_penalty",
    "compute_kl_loss",
    "compute_value_loss",
    "cu_seqlens_from_mask",
    "entropy_bonus",
    "entropy_from_logits",
    "explained_variance",
    "get_adv_estimator",
    "get_kl_controller",
    "get_kl_estimator",
    "get_policy_loss",
    "get_weight_level",
    "group_ids",
    "group_stats",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_stats",
    "pack_padded",
    "pad_packed",
    "rejection_mask",
    "rollout_correction",
    "scores_to_token_rewards",
    "seq_lengths",
    "truncated_is_weights",
]
