"""Config sections → verl_core objects: the policy, reward scorers, sampling parameters, optimizer
specs, rollout engine arguments, and the number of RL iterations a run plans. Stages call these so
that one config knob means one thing everywhere (the RL loop, validation, eval, benchmarks)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn

from verl_core.algorithms.registry import Registry
from verl_core.config import ModelConfig, RewardConfig, RolloutConfig, VerlFlowConfig
from verl_core.errors import ConfigError
from verl_core.models.loading import (
    QuantSpec,
    ScratchSpec,
    apply_lora,
    enable_gradient_checkpointing,
    init_causal_lm,
    load_causal_lm,
    scratch_config,
)
from verl_core.reward import (
    FunctionScorer,
    RuleOptions,
    RuleScorer,
    Scorer,
    WeightedScorer,
    load_reward_function,
)
from verl_core.rollout import SamplingParams
from verl_core.training.engine import OptimSpec

# --------------------------------------------------------------------------------------------------
# Policy


def build_policy(model: ModelConfig, tokenizer: Any, *, seed: int) -> nn.Module:
    """The initial policy: a scratch model sized by ``model`` for ``tokenizer``'s vocabulary, or the
    pretrained ``model.path``; LoRA adapters when ``model.lora_rank > 0``."""
    quant = None
    if model.quantization is not None:
        if model.lora_rank == 0:
            raise ConfigError(
                "model.quantization: a quantized base can only be trained with LoRA (model.lora_rank > 0)"
            )
        q = model.quantization
        quant = QuantSpec(q.bits, q.quant_type, q.double_quant, q.compute_dtype)
    if model.init == "scratch":
        if quant is not None:
            raise ConfigError("model.quantization: not supported for model.init=scratch")
        spec = ScratchSpec(
            model.architecture,
            model.hidden_size,
            model.num_hidden_layers,
            model.num_attention_heads,
            model.num_key_value_heads,
            model.intermediate_size,
            model.max_position_embeddings,
        )
        config = scratch_config(
            spec, len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        lm = init_causal_lm(
            config, seed=seed, dtype=model.dtype, attn_implementation=model.attn_implementation
        )
    else:
        assert model.path is not None  # the config's cross-checks guarantee it
        lm = load_causal_lm(
            model.path,
            dtype=model.dtype,
            attn_implementation=model.attn_implementation,
            trust_remote_code=model.trust_remote_code,
            quantization=quant,
        )
    if model.lora_rank > 0:
        lm = apply_lora(
            lm,
            rank=model.lora_rank,
            alpha=model.lora_alpha,
            dropout=model.lora_dropout,
            target_modules=model.target_modules,
            quantized=quant is not None,
        )
    if model.gradient_checkpointing:
        enable_gradient_checkpointing(lm)
    return lm


# --------------------------------------------------------------------------------------------------
# Reward scorers: one builder per scorer name

SCORER_BUILDERS: Registry[Callable[[RewardConfig], Scorer]] = Registry("reward scorer")


@SCORER_BUILDERS.register("rule")
def _rule(cfg: RewardConfig) -> Scorer:
    options = RuleOptions(cfg.gsm8k_method, cfg.score, cfg.format_score)
    return RuleScorer(options, cfg.num_workers, cfg.parallel_min_samples)


@SCORER_BUILDERS.register("function")
def _function(cfg: RewardConfig) -> Scorer:
    assert cfg.function is not None  # the config requires it with this scorer
    return FunctionScorer(load_reward_function(cfg.function), cfg.function_mode, cfg.timeout_s)


@SCORER_BUILDERS.register("model")
def _model(cfg: RewardConfig) -> Scorer:
    from verl_core.models.loading import resolve_device
    from verl_core.reward.model import ModelScorer, load_reward_scorer

    assert cfg.model_path is not None  # the config requires it with this scorer
    device = resolve_device(cfg.model_device)
    model, tokenizer = load_reward_scorer(cfg.model_path, dtype=cfg.model_dtype, device=device)
    return ModelScorer(model, tokenizer, cfg.model_max_tokens_per_batch)


def build_scorers(cfg: RewardConfig) -> list[WeightedScorer]:
    """The weighted scorers of ``reward.scorers`` (loads the function / reward model they name)."""
    return [WeightedScorer(s.name, s.weight, SCORER_BUILDERS.get(s.name)(cfg)) for s in cfg.scorers]


# --------------------------------------------------------------------------------------------------
# Rollout


def sampling_params(
    rollout: RolloutConfig, max_new_tokens: int, iteration: int, *, validation: bool
) -> SamplingParams:
    """Sampling of iteration ``iteration``'s training rollouts, or of its validation (greedy by default);
    seeded by (rollout.seed, iteration), validation apart from training."""
    temperature = rollout.val_temperature if validation else rollout.temperature
    return SamplingParams(
        n=rollout.val_n if validation else rollout.n,
        temperature=temperature,
        top_p=1.0 if validation else rollout.top_p,
        top_k=-1 if validation else rollout.top_k,
        max_new_tokens=max_new_tokens,
        stop=tuple(rollout.stop),
        seed=rollout.seed * 1_000_003 + iteration + (500_000 if validation else 0),
    )


def engine_kwargs(rollout: RolloutConfig) -> dict[str, Any]:
    """Keyword arguments of ``verl_core.rollout.make_engine`` for ``rollout.name``."""
    if rollout.name == "vllm":
        return {
            "tensor_parallel_size": rollout.tensor_parallel_size,
            "gpu_memory_utilization": rollout.gpu_memory_utilization,
        }
    return {"max_batch_size": rollout.max_batch_size}


# --------------------------------------------------------------------------------------------------
# RL schedule and optimizers


def planned_iterations(cfg: VerlFlowConfig, n_prompts: int) -> int:
    """RL iterations of the run: ``trainer.total_iterations``, capped by ``trainer.total_epochs`` passes
    over the ``n_prompts`` training prompts (each iteration takes ``data.train_batch_size`` of them)."""
    t = cfg.trainer
    return min(t.total_iterations, math.ceil(t.total_epochs * n_prompts / cfg.data.train_batch_size))


def actor_spec(cfg: VerlFlowConfig, iterations: int) -> OptimSpec:
    """The actor's optimizer and LR schedule over ``iterations`` RL iterations
    (``actor.ppo_epochs`` × mini-batches optimizer steps each)."""
    a = cfg.actor
    total = iterations * a.ppo_epochs * (cfg.data.train_batch_size // a.ppo_mini_batch_size)
    return OptimSpec(
        lr=a.lr,
        weight_decay=a.weight_decay,
        warmup_steps=int(a.warmup_steps_ratio * total),
        total_steps=total,
        scheduler=a.lr_scheduler,
        grad_clip=a.grad_clip,
    )


def critic_spec(cfg: VerlFlowConfig, iterations: int) -> OptimSpec:
    """The critic's optimizer over ``iterations`` RL iterations (constant LR)."""
    c = cfg.critic
    total = iterations * c.ppo_epochs * (cfg.data.train_batch_size // c.ppo_mini_batch_size)
    return OptimSpec(
        lr=c.lr,
        weight_decay=c.weight_decay,
        warmup_steps=0,
        total_steps=total,
        scheduler="constant",
        grad_clip=c.grad_clip,
    )
