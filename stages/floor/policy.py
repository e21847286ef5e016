"""The policy a run trains and the reference it is held to, built from the config's ``model`` and
``ref`` sections: the QLoRA quantization of the base, the initial policy (scratch or pretrained, LoRA
adapters), an actor/critic/ref section's mixed precision, the frozen reference."""

from __future__ import annotations

from typing import Any

from torch import nn

from stages.floor.initial_model import model_dir
from verl_core.config import MixedPrecisionConfig, ModelConfig, VerlFlowConfig
from verl_core.errors import ConfigError
from verl_core.models.loading import (
    QuantSpec,
    ScratchSpec,
    apply_liger,
    apply_lora,
    enable_gradient_checkpointing,
    init_causal_lm,
    load_causal_lm,
    scratch_config,
    unwrap,
)
from verl_core.training.precision import MixedPrecision


def quant_spec(model: ModelConfig) -> QuantSpec | None:
    """The bitsandbytes quantization of the base (QLoRA), None without ``model.quantization``."""
    if model.quantization is None:
        return None
    if model.lora_rank == 0:
        raise ConfigError(
            "model.quantization: a quantized base can only be trained with LoRA (model.lora_rank > 0)"
        )
    q = model.quantization
    return QuantSpec(q.bits, q.quant_type, q.double_quant, q.compute_dtype)


def build_policy(model: ModelConfig, tokenizer: Any, *, seed: int) -> nn.Module:
    """The initial policy: a scratch model sized by ``model`` for ``tokenizer``'s vocabulary, or the
    pretrained ``model.path``; LoRA adapters when ``model.lora_rank > 0``."""
    quant = quant_spec(model)
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
            model_dir(model.path),  # a store URI: this process's copy (stages.floor.initial_model)
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
    if model.use_liger:
        apply_liger(lm)
    if model.gradient_checkpointing:
        enable_gradient_checkpointing(lm)
    return lm


def mixed_precision(section: MixedPrecisionConfig) -> MixedPrecision | None:
    """The ``mixed_precision`` of an actor/critic/ref section; None when ``param_dtype`` is unset."""
    return MixedPrecision.from_names(section.param_dtype, section.reduce_dtype, section.buffer_dtype)


def load_reference(cfg: VerlFlowConfig, policy: nn.Module) -> nn.Module:
    """The frozen reference policy ``ref.path`` (hub id or local dir). It scores the policy's tokens,
    so a vocabulary other than the policy's is refused."""
    assert cfg.ref.path is not None
    ref = load_causal_lm(
        cfg.ref.path,
        dtype=cfg.model.dtype,
        attn_implementation=cfg.model.attn_implementation,
        trust_remote_code=cfg.model.trust_remote_code,
        field="ref.path",
    )
    ours, theirs = unwrap(policy).config.vocab_size, ref.config.vocab_size
    if ours != theirs:
        raise ConfigError(
            f"ref.path: {cfg.ref.path!r} has a vocabulary of {theirs} tokens, the policy {ours}: "
            "the reference must use the policy's tokenizer"
        )
    return ref.eval().requires_grad_(False)
