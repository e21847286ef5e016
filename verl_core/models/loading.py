"""Building and loading models: HF hub id or local dir, from-scratch tiny models, LoRA / QLoRA.

Plain arguments in (the stage unpacks ``ModelConfig``), ``torch.nn.Module`` out. ``trust_remote_code``
is passed through explicitly and is off unless the caller sets it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verl_core.errors import ConfigError, VerlFlowError
from verl_core.runtime.doctor import require

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(VerlFlowError):
    """A model path that does not exist, an unreadable checkpoint, an unsupported setting."""


@dataclass(frozen=True)
class ScratchSpec:
    """Sizes of a model built from scratch (tests, quickstart)."""

    architecture: str  # "qwen2" | "llama"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int


@dataclass(frozen=True)
class QuantSpec:
    """bitsandbytes quantization of the frozen base weights (QLoRA)."""

    bits: int  # 4 | 8
    quant_type: str  # "nf4" | "fp4"
    double_quant: bool
    compute_dtype: str


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype {name!r}: expected one of {', '.join(_DTYPES)}") from None


def resolve_device(name: str, field: str = "trainer.device") -> torch.device:
    """``auto`` → cuda when available else cpu. ``cuda`` runs the environment check first
    (:func:`verl_core.runtime.doctor.require`): a CPU build of torch, no visible GPU or a broken pin is a
    :class:`ConfigError` naming ``field`` and the fix."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        require(cuda_needed_by=f"{field}: 'cuda'")
    return torch.device(name)


def check_attention(attn_implementation: str) -> None:
    """flash_attention_2 needs the flash-attn package and a CUDA device; say so before loading."""
    if attn_implementation != "flash_attention_2":
        return
    field = "model.attn_implementation: 'flash_attention_2' (use 'sdpa' on CPU)"
    require({"flash-attn": field}, cuda_needed_by=field)


def scratch_config(spec: ScratchSpec, vocab_size: int, *, eos_token_id: int, pad_token_id: int) -> Any:
    """An HF config for a small decoder-only model of ``spec`` sizes (tied embeddings)."""
    from transformers import LlamaConfig, Qwen2Config

    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig}
    if spec.architecture not in classes:
        raise ConfigError(
            f"model.architecture: got {spec.architecture!r}, expected one of {', '.join(classes)}"
        )
    if spec.hidden_size % spec.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size: {spec.hidden_size} is not divisible by num_attention_heads "
            f"({spec.num_attention_heads})"
        )
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ConfigError(
            f"model.num_key_value_heads: {spec.num_key_value_heads} must divide num_attention_heads "
            f"({spec.num_attention_heads})"
        )
    return classes[spec.architecture](
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        use_cache=False,
    )


def init_causal_lm(
    config: Any, *, seed: int, dtype: str = "float32", attn_implementation: str = "sdpa"
) -> nn.Module:
    """A randomly initialised causal LM for ``config`` (deterministic for a given seed)."""
    from transformers import AutoModelForCausalLM

    check_attention(attn_implementation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=torch_dtype(dtype)
        )
    model.config.use_cache = False
    return model


def load_causal_lm(
    path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    quantization: QuantSpec | None = None,
    field: str = "model.path",
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path)`` (hub id or local dir) with a clear error, naming
    the config ``field`` the path came from, when the path does not exist or cannot be read."""
    from transformers import AutoModelForCausalLM

    check_attention(attn_implementation)
    kwargs: dict[str, Any] = {
        "dtype": torch_dtype(dtype),
        "attn_implementation": attn_implementation,
        "trust_remote_code": trust_remote_code,
    }
    if quantization is not None:
        kwargs["quantization_config"] = bnb_config(quantization)
    if not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise ModelLoadError(f"{field}: {path!r} is not a directory (and not a hub id like 'org/name')")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise ModelLoadError(f"{field}: cannot load {path!r}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # safetensors / config errors from deep inside transformers
        raise ModelLoadError(
            f"{field}: {path!r} is not a loadable checkpoint: {type(e).__name__}: {e}"
        ) from None
    model.config.use_cache = False
    if quantization is not None:
        _disable_avx512_bf16_repack(model)
    else:
        own_memory(model)
    return model


def own_memory(model: nn.Module) -> nn.Module:
    """Give every parameter and buffer of a model read from files a fresh allocation of its own.
    ``from_pretrained`` leaves the tensors as views into the safetensors buffer, at the alignment the
    file's layout gives (16 bytes), while tensors built in memory are 64-byte aligned, and MKL's GEMMs
    round differently for the two: a run resumed with its critic read back from a checkpoint updated
    it differently in the last bit from the run that built the critic in memory. Tied parameters stay
    tied (each parameter object once)."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone(memory_format=torch.contiguous_format)
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.clone(memory_format=torch.contiguous_format)
    return model


def bnb_config(spec: QuantSpec) -> Any:
    """``BitsAndBytesConfig`` for ``spec``; a clear error where bitsandbytes is not installed."""
    require({"bitsandbytes": "model.quantization"})
    from transformers import BitsAndBytesConfig

    if spec.bits == 4:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=spec.quant_type,
            bnb_4bit_use_double_quant=spec.double_quant,
            bnb_4bit_compute_dtype=torch_dtype(spec.compute_dtype),
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def _disable_avx512_bf16_repack(model: nn.Module) -> None:
    # bitsandbytes 0.50: on CPUs with AVX512-BF16 an eval-mode forward repacks 4-bit weights into a path
    # without autograd, after which LoRA gets no gradients. Turning the fast path off avoids it.
    try:
        import bitsandbytes as bnb
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: int,
    dropout: float,
    target_modules: list[str] | str,
    quantized: bool = False,
) -> nn.Module:
    """Wrap ``model`` with LoRA adapters (PEFT). Base weights are frozen; for a quantized base the
    model is first prepared for k-bit training."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
        bias="none",
    )
    return get_peft_model(model, config)


# model_type → liger-kernel's patch function for it (``liger_kernel.transformers``)
LIGER_PATCHES = {"qwen2": "apply_liger_kernel_to_qwen2", "llama": "apply_liger_kernel_to_llama"}


def apply_liger(model: nn.Module, *, field: str = "model.use_liger") -> None:
    """Swap ``model``'s RMSNorm, rotary embedding and SwiGLU MLP for liger-kernel's fused Triton
    kernels, in place (liger also patches the transformers classes, so models of the same type built
    afterwards in this process get them too). Liger's (fused linear) cross-entropy is left off: it
    returns a loss, not per-token log-probs and entropies; the chunked log-prob
    (:mod:`verl_core.models.packed`) keeps computing those.

    Needs liger-kernel (``pip install 'verl-flow[liger]'``) and a CUDA device: a :class:`ConfigError`
    naming ``field`` and the fix otherwise (Triton has no CPU backend)."""
    require({"liger-kernel": field}, cuda_needed_by=field)
    base = unwrap(model)
    model_type = getattr(base.config, "model_type", None)
    if model_type not in LIGER_PATCHES:
        valid = ", ".join(LIGER_PATCHES)
        raise ConfigError(f"{field}: no liger patch for model type {model_type!r}; valid: {valid}")
    import liger_kernel.transformers as liger

    patch = getattr(liger, LIGER_PATCHES[model_type])
    kernels = {"rope": True, "rms_norm": True, "swiglu": True}
    patch(**kernels, cross_entropy=False, fused_linear_cross_entropy=False, model=base)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations during backward (identical loss and gradients, less memory)."""
    base = unwrap(model)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(base, "enable_input_require_grads"):
        base.enable_input_require_grads()


def unwrap(model: nn.Module) -> Any:
    """The HF ``PreTrainedModel`` inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
