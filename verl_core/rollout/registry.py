"""Rollout engines by name: ``make_engine("hf" | "vllm", model, tokenizer, **engine_kwargs)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from verl_core.errors import ConfigError
from verl_core.rollout.base import RolloutEngine

EngineFactory = Callable[..., RolloutEngine]
ENGINES: dict[str, EngineFactory] = {}


def register_engine(name: str) -> Callable[[EngineFactory], EngineFactory]:
    def add(factory: EngineFactory) -> EngineFactory:
        ENGINES[name] = factory
        return factory

    return add


@register_engine("hf")
def _hf(model: str | nn.Module, tokenizer: Any, **kwargs: Any) -> RolloutEngine:
    from verl_core.rollout.hf import HFEngine

    return HFEngine(model, tokenizer, **kwargs)


@register_engine("vllm")
def _vllm(model: str | nn.Module, tokenizer: Any, **kwargs: Any) -> RolloutEngine:
    from verl_core.rollout.vllm import VLLMEngine

    return VLLMEngine(model, tokenizer, **kwargs)


def make_engine(name: str, model: str | nn.Module, tokenizer: Any = None, **kwargs: Any) -> RolloutEngine:
    """The engine registered as ``name``, built from ``model`` (path / hub id or live module)."""
    if name not in ENGINES:
        raise ConfigError(f"rollout.name: got {name!r}, expected one of {', '.join(sorted(ENGINES))}")
    return ENGINES[name](model, tokenizer, **kwargs)
