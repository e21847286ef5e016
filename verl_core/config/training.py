"""The training sections: SFT warm-up, actor, critic, reference policy, and the algorithm (advantages,
KL, rollout correction, dynamic sampling)."""

from __future__ import annotations

from typing import Literal

from verl_core.algorithms import KLControllerName, LossAggMode, RolloutISLevel, RolloutRSLevel
from verl_core.config.base import (
    AdvEstimator,
    KLEstimator,
    NonNegFloat,
    NonNegInt,
    PolicyLoss,
    PositiveFloat,
    PositiveInt,
    Prob,
    Section,
    Strategy,
    _f,
)
from verl_core.config.model import MixedPrecisionConfig


class SFTConfig(Section):
    enable: bool = _f(True, "Run the SFT warm-up stage before RL")
    epochs: PositiveInt = _f(2, "Passes over the SFT data")
    max_steps: NonNegInt = _f(0, "Stop after this many optimizer steps (0: no limit)")
    lr: PositiveFloat = _f(3e-3, "Peak learning rate")
    weight_decay: NonNegFloat = _f(0.0, "AdamW weight decay")
    warmup_ratio: Prob = _f(0.05, "Fraction of steps spent in linear warm-up")
    lr_scheduler: Literal["constant", "cosine"] = _f("cosine", "Schedule after warm-up")
    grad_clip: PositiveFloat = _f(1.0, "Clip the global gradient norm to this")
    batch_size: PositiveInt = _f(32, "Sequences per optimizer step")
    max_token_len_per_batch: PositiveInt = _f(4096, "Token budget of one packed micro-batch")
    val_every: NonNegInt = _f(50, "Validation loss every this many steps (0: end of each epoch only)")
    save_every: NonNegInt = _f(50, "Checkpoint weights + trainer state every this many steps (0: at the end)")
    log_every: PositiveInt = _f(10, "Log training metrics every this many steps")


class ActorConfig(Section):
    strategy: Strategy = _f(
        "single",
        "Training engine: single (one process), fsdp2 (fully_shard per decoder layer) or deepspeed (ZeRO "
        "actor.zero_stage); fsdp2/deepspeed shard over the trainer.nnodes × trainer.n_gpus_per_node ranks",
    )
    param_offload: bool = _f(False, "fsdp2: keep sharded parameters, grads and optimizer state on the CPU")
    tensor_parallel_size: PositiveInt = _f(
        1, "fsdp2: tensor-parallel degree of the attention/MLP projections (a 2-D data × tensor mesh)"
    )
    mixed_precision: MixedPrecisionConfig = _f(
        MixedPrecisionConfig(),
        "bf16 compute with fp32 master weights (the actor's update, old log-probs, SFT)",
    )
    lr: PositiveFloat = _f(1e-6, "Actor learning rate")
    weight_decay: NonNegFloat = _f(0.01, "AdamW weight decay")
    warmup_steps_ratio: Prob = _f(0.0, "Fraction of updates in linear warm-up")
    lr_scheduler: Literal["constant", "cosine"] = _f("constant", "Schedule after warm-up")
    grad_clip: PositiveFloat = _f(1.0, "Clip the global gradient norm to this")
    ppo_epochs: PositiveInt = _f(1, "Passes over each iteration's rollouts")
    ppo_mini_batch_size: PositiveInt = _f(4, "Prompts per optimizer step (times rollout.n samples)")
    use_dynamic_bsz: bool = _f(True, "Token-budget micro-batches instead of a fixed count")
    ppo_micro_batch_size_per_gpu: PositiveInt = _f(8, "Samples per micro-batch when use_dynamic_bsz=false")
    ppo_max_token_len_per_gpu: PositiveInt = _f(4096, "Token budget of one micro-batch")
    policy_loss: PolicyLoss = _f("vanilla", "Policy loss (PPO clip or GSPO)")
    clip_ratio: NonNegFloat = _f(0.2, "PPO clip range ε (both sides unless low/high are set)")
    clip_ratio_low: NonNegFloat | None = _f(None, "Lower clip ε (None: clip_ratio)")
    clip_ratio_high: NonNegFloat | None = _f(None, "Upper clip ε, clip-higher (None: clip_ratio)")
    clip_ratio_c: float = _f(3.0, "Dual-clip bound c > 1 applied where the advantage is negative", gt=1.0)
    loss_agg_mode: LossAggMode | None = _f(
        None,
        "How token losses (policy, entropy, KL) become one number (None: token-mean, or "
        "seq-mean-token-mean under policy_loss=gspo, as verl)",
    )
    entropy_coeff: NonNegFloat = _f(0.0, "Entropy bonus coefficient")
    use_kl_loss: bool = _f(False, "Add a KL(actor || ref) loss term (GRPO style)")
    kl_loss_coef: NonNegFloat = _f(0.001, "Coefficient of the KL loss")
    kl_loss_type: KLEstimator = _f("low_var_kl", "KL estimator of the loss term")
    use_rollout_logprobs: bool = _f(False, "Use the rollout engine's log-probs as old log-probs")
    zero_stage: Literal[1, 2, 3] = _f(2, "DeepSpeed ZeRO stage (strategy=deepspeed)")

    @property
    def resolved_loss_agg_mode(self) -> LossAggMode:
        """``loss_agg_mode`` if given, else verl's choice: seq-mean-token-mean for GSPO (a sequence-level
        ratio, averaged per sequence), token-mean otherwise."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"


class CriticConfig(Section):
    enable: bool | None = _f(None, "Train a critic (None: only when algorithm.adv_estimator=gae)")
    strategy: Strategy = _f("single", "Training engine of the critic (see actor.strategy)")
    zero_stage: Literal[1, 2, 3] = _f(2, "DeepSpeed ZeRO stage (strategy=deepspeed)")
    param_offload: bool = _f(False, "fsdp2: keep sharded parameters, grads and optimizer state on the CPU")
    mixed_precision: MixedPrecisionConfig = _f(MixedPrecisionConfig(), "bf16 compute of the critic")
    path: str | None = _f(None, "Critic init: None to start from the policy's backbone, or a model path")
    lr: PositiveFloat = _f(1e-5, "Critic learning rate")
    weight_decay: NonNegFloat = _f(0.01, "AdamW weight decay")
    grad_clip: PositiveFloat = _f(1.0, "Clip the global gradient norm to this")
    ppo_epochs: PositiveInt = _f(1, "Passes over each iteration's rollouts")
    ppo_mini_batch_size: PositiveInt = _f(4, "Prompts per critic optimizer step")
    ppo_max_token_len_per_gpu: PositiveInt = _f(4096, "Token budget of one micro-batch")
    cliprange_value: NonNegFloat = _f(0.5, "Value clip range around the old values")
    loss_agg_mode: LossAggMode = _f("token-mean", "How token value losses become one number")


class RefConfig(Section):
    path: str | None = _f(
        None,
        "A reference policy other than the starting policy (HF id or local dir); None: the SFT/start "
        "policy (for LoRA, the base without adapters)",
    )
    log_prob_max_token_len_per_gpu: PositiveInt = _f(8192, "Token budget of one reference forward")
    strategy: Literal["single", "fsdp2"] = _f(
        "single", "How the frozen reference is placed: single (a full copy per rank) or fsdp2 (sharded)"
    )
    param_offload: bool = _f(False, "fsdp2: keep the sharded reference parameters on the CPU")
    mixed_precision: MixedPrecisionConfig = _f(
        MixedPrecisionConfig(), "bf16 compute of the reference's forwards (a LoRA ref follows the actor)"
    )


class KLControlConfig(Section):
    type: KLControllerName = _f("fixed", "KL coefficient controller")
    kl_coef: NonNegFloat = _f(0.001, "Initial β of the KL-in-reward penalty")
    target_kl: PositiveFloat = _f(0.1, "Target KL of the adaptive controller")
    horizon: PositiveInt = _f(10000, "Horizon of the adaptive controller")


class RolloutCorrectionConfig(Section):
    rollout_is: RolloutISLevel | None = _f(
        None, "Truncated importance weights π_old/π_rollout on the actor loss: token | sequence (None: off)"
    )
    rollout_is_threshold: PositiveFloat = _f(2.0, "Truncation C of the importance weights (w ← min(w, C))")
    rollout_rs: RolloutRSLevel | None = _f(
        None, "Reject tokens/sequences whose weight leaves the thresholds: token | sequence | geometric"
    )
    rollout_rs_threshold: PositiveFloat = _f(2.0, "Rejection sampling: upper bound of a kept weight")
    rollout_rs_threshold_lower: PositiveFloat | None = _f(
        None, "Rejection sampling: lower bound of a kept weight (None: 1 / rollout_rs_threshold)"
    )
    log_prob_diff_threshold: PositiveFloat = _f(
        0.1, "Metric rollout_corr/log_prob_abs_diff_frac_above counts tokens with |Δ log-prob| above this"
    )


class FilterGroupsConfig(Section):
    enable: bool = _f(False, "DAPO dynamic sampling: drop prompt groups whose samples agree on the metric")
    metric: Literal["acc", "score"] = _f("acc", "What must differ within a group: acc (correct) or score")
    max_num_gen_batches: NonNegInt = _f(
        10, "Generation batches per iteration at most; then train on the groups found (0: no limit)"
    )


class AlgorithmConfig(Section):
    adv_estimator: AdvEstimator = _f("grpo", "Advantage estimator")
    gamma: Prob = _f(1.0, "Discount factor")
    lam: Prob = _f(1.0, "GAE λ")
    norm_adv_by_std_in_grpo: bool = _f(True, "Divide GRPO advantages by the group std (false: Dr.GRPO)")
    use_kl_in_reward: bool = _f(False, "Subtract β·KL(actor || ref) from the token rewards")
    kl_penalty: KLEstimator = _f("kl", "KL estimator used in the reward")
    kl_ctrl: KLControlConfig = _f(KLControlConfig(), "KL coefficient control")
    rollout_correction: RolloutCorrectionConfig = _f(
        RolloutCorrectionConfig(), "Rollout/trainer log-prob mismatch: metrics, importance weights, rejection"
    )
    filter_groups: FilterGroupsConfig = _f(FilterGroupsConfig(), "DAPO dynamic sampling (oversample, filter)")

    @property
    def greedy_baseline(self) -> bool:
        """ReMax's baseline is the reward of a greedy response: the rollout samples one per prompt."""
        return self.adv_estimator == "remax"
