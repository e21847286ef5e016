"""Rollout engines behind one :class:`RolloutEngine` protocol, chosen by name with :func:`make_engine`.

``HFEngine`` (transformers generate, CPU or one GPU, colocated with the trainer) and ``VLLMEngine``
(GPU worker image; vllm is imported only when one is built)."""

from verl_core.rollout.base import Completion, RolloutEngine, SamplingParams
from verl_core.rollout.hf import HFEngine
from verl_core.rollout.registry import ENGINES, make_engine, register_engine
from verl_core.rollout.vllm import VLLMEngine

__all__ = [
    "ENGINES",
    "Completion",
    "HFEngine",
    "RolloutEngine",
    "SamplingParams",
    "VLLMEngine",
    "make_engine",
    "register_engine",
]
