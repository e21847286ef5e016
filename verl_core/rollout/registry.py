"""Rollout engines by name: ``make_engine("hf" | "vllm", model, tokenizer, **engine_kwargs)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from verl_core.errors import ConfigError
from verl_core.registry import Registry, UnknownNameError
from verl_core.rollout.base import RolloutEngine

EngineFactory = Callable[..., RolloutEngine]
ENGINES: Registry[EngineFactory] = Registry("rollout engine")


def register_engine(name: str) -> Callable[[EngineFactory], EngineFactory]:
    """Decorator registering an engine factory ``(model, tokenizer, **kwargs) -> RolloutEngine``."""
    return ENGINES.register(name)


@register_engine("hf")
def _hf(model: str | nn.Module, tokenizer: Any, **kwargs: Any) -> RolloutEngine:
    from verl_core.rollout.hf import HFEngine

    return HFEngine(model, tokenizer, **kwargs)


@register_engine("vllm")
def _vllm(
    model: str | nn.Module, tokenizer: Any, *, vllm_python: str = "auto", **kwargs: Any
) -> RolloutEngine:
    """vLLM in this process where it imports (its own environment, a GPU worker image), else in a
    subprocess of the vLLM environment (``vllm_python``, :mod:`verl_core.rollout.vllm_process`)."""
    from verl_core.rollout.vllm import VLLMEngine, vllm_available

    if vllm_available():
        return VLLMEngine(model, tokenizer, **kwargs)
    from verl_core.rollout.vllm_process import VLLMProcessEngine, resolve_vllm_python

    return VLLMProcessEngine(model, tokenizer, python=resolve_vllm_python(vllm_python), **kwargs)


def make_engine(name: str, model: str | nn.Module, tokenizer: Any = None, **kwargs: Any) -> RolloutEngine:
    """The engine registered as ``name``, built from ``model`` (path / hub id or live module)."""
    try:
        factory = ENGINES.get(name)
    except UnknownNameError as e:
        raise ConfigError(f"rollout.name: {e}") from None
    return factory(model, tokenizer, **kwargs)
