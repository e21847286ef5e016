"""Rollout engines behind one :class:`RolloutEngine` protocol, chosen by name with :func:`make_engine`.

``HFEngine`` (transformers generate, CPU or one GPU, colocated with the trainer) and ``VLLMEngine``
(vLLM, in its own environment: in this process where vllm imports, else through
``VLLMProcessEngine``'s subprocess; vllm is imported only when one is built)."""

from verl_core.rollout.base import Completion, RolloutEngine, SamplingParams
from verl_core.rollout.hf import HFEngine
from verl_core.rollout.registry import ENGINES, make_engine, register_engine
from verl_core.rollout.vllm import VLLMEngine
from verl_core.rollout.vllm_process import VLLMProcessEngine

__all__ = [
    "ENGINES",
    "Completion",
    "HFEngine",
    "RolloutEngine",
    "SamplingParams",
    "VLLMEngine",
    "VLLMProcessEngine",
    "make_engine",
    "register_engine",
]
