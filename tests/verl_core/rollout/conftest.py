"""A tiny tokenizer and Qwen2 model shared by the rollout tests (built once per module)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.vllm.spec import engine_spec
from verl_core.data.tokenizer import train_tokenizer
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.rollout.vllm_spec import VLLMSpec


def arithmetic_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Q: {rng.randint(0, 99)} + {rng.randint(0, 99)} = ? A: {rng.randint(0, 200)}" for _ in range(n)]


@pytest.fixture(scope="package")
def tok() -> Any:
    return train_tokenizer(arithmetic_texts(400), 300)


def tiny_model(tok: Any, seed: int = 0, max_positions: int = 128) -> torch.nn.Module:
    spec = ScratchSpec("qwen2", 32, 2, 4, 2, 64, max_positions)
    config = scratch_config(spec, len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return init_causal_lm(config, seed=seed)


@pytest.fixture(scope="package")
def model(tok: Any) -> torch.nn.Module:
    return tiny_model(tok)


@pytest.fixture(scope="package")
def prompts() -> list[str]:
    # ragged lengths, deliberately not sorted
    return ["Q: 12 + 7 = ? A:", "Q: 3 + 4", "Q: 45 + 45 = ? A: 90 Q: 1 + 2 = ? A:", "Q:"]


def vllm_spec(**changes: Any) -> VLLMSpec:
    """The vLLM environment's test spec (fp32, eager, a 0.25 GiB KV cache on CPU) with 128 positions and
    1 MiB weight-sync buckets (several files for a tiny model)."""
    return engine_spec(**{"max_model_len": 128, "weight_sync_bucket_mb": 1, **changes})
