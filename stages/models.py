"""Stage-side model helpers: unpack ``ModelConfig`` into ``verl_core.models`` calls, and move policy
checkpoints in and out of the artifact store.

A policy checkpoint is a set of files under a prefix of a stage's output:
``{prefix}/...`` an HF model dir (safetensors + config + tokenizer) for full fine-tuning, or a PEFT
adapter dir for LoRA, in which case a model built from scratch also has its frozen base under
``{prefix}-base/`` (a pretrained base is reloaded from ``model.path``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from verl_core.config import ModelConfig
from verl_core.errors import ConfigError
from verl_core.models.checkpoint import model_files, write_files
from verl_core.models.loading import (
    QuantSpec,
    ScratchSpec,
    apply_lora,
    enable_gradient_checkpointing,
    init_causal_lm,
    load_causal_lm,
    scratch_config,
    unwrap,
)
from verl_core.store import ArtifactStore, Manifest, StageWriter


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


def write_policy(stage: StageWriter, prefix: str, lm: nn.Module, tokenizer: Any, model: ModelConfig) -> None:
    """Write a policy checkpoint under ``prefix`` (see the module docstring)."""
    for name, data in model_files(lm, tokenizer).items():
        stage.write_bytes(f"{prefix}/{name}", data)
    if model.lora_rank > 0 and model.init == "scratch":
        for name, data in model_files(_plain_base(lm), None).items():
            stage.write_bytes(f"{prefix}-base/{name}", data)


def _plain_base(lm: nn.Module) -> nn.Module:
    """The frozen base of a PEFT model as a plain HF model. ``get_base_model()`` still holds the
    injected LoRA layers, whose weights are named ``...base_layer.weight``: saved as is, they would
    not load back into the architecture (the base would be silently re-initialised)."""
    from transformers import AutoModelForCausalLM

    base = unwrap(lm)
    weights = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if "lora_" not in k}
    plain = AutoModelForCausalLM.from_config(base.config, dtype=base.dtype)
    plain.load_state_dict(weights, strict=True)
    return plain


def read_policy(store: ArtifactStore, manifest: Manifest, prefix: str, model: ModelConfig) -> nn.Module:
    """Load a policy checkpoint written by :func:`write_policy` (trainable LoRA adapters included)."""
    from peft import PeftModel

    with tempfile.TemporaryDirectory() as tmp:
        policy_dir = _materialise(store, manifest, prefix, Path(tmp) / "policy")
        if model.lora_rank == 0:
            return load_causal_lm(
                str(policy_dir),
                dtype=model.dtype,
                attn_implementation=model.attn_implementation,
                trust_remote_code=model.trust_remote_code,
            )
        if model.init == "scratch":
            base_path = str(_materialise(store, manifest, f"{prefix}-base", Path(tmp) / "base"))
        else:
            assert model.path is not None
            base_path = model.path
        base = load_causal_lm(
            base_path,
            dtype=model.dtype,
            attn_implementation=model.attn_implementation,
            trust_remote_code=model.trust_remote_code,
        )
        return PeftModel.from_pretrained(base, str(policy_dir), is_trainable=True)


def _materialise(store: ArtifactStore, manifest: Manifest, prefix: str, directory: Path) -> Path:
    files = {
        f.name[len(prefix) + 1 :]: store.read_bytes(manifest, f.name)
        for f in manifest.files
        if f.name.startswith(prefix + "/")
    }
    if not files:
        raise ConfigError(
            f"stage {manifest.stage!r} of run {manifest.run_id!r} has no checkpoint under {prefix}/"
        )
    return write_files(files, directory)
