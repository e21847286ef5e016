"""VLLMEngine with a LoRA policy: the base is loaded once, every sync sends the adapter as a new
``LoRARequest``; checked on content (the engine's log-probs are the PEFT model's) and on payload
names. One engine start for the module."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from verl_core.errors import ConfigError
from verl_core.models.loading import apply_lora
from verl_core.rollout import SamplingParams
from verl_core.rollout.vllm import VLLMEngine

from .checks import TOL, assert_engine_holds, max_logprob_gap
from .conftest import tiny_qwen2
from .spec import engine_spec


def merged(peft: torch.nn.Module) -> torch.nn.Module:
    """The plain model the trainer's reference log-probs are computed with (adapter merged in)."""
    return copy.deepcopy(peft).merge_and_unload().eval()


def lora_policy(tok: Any) -> torch.nn.Module:
    peft = apply_lora(tiny_qwen2(tok, seed=2), rank=8, alpha=16, dropout=0.0, target_modules="all-linear")
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for name, p in peft.named_parameters():
            if "lora_B" in name:  # PEFT starts B at 0 (a no-op adapter): give it content
                p.normal_(0, 0.2)
    return peft.eval()


def lora_update(peft: torch.nn.Module, prompts: list[list[int]]) -> torch.nn.Module:
    """A copy after one Adam step on the adapter (the base is frozen by PEFT)."""
    new = copy.deepcopy(peft).train()
    optim = torch.optim.Adam([p for p in new.parameters() if p.requires_grad], lr=5e-2)
    ids = torch.tensor([prompts[0] + prompts[1]])
    new(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    return new.eval()


@pytest.fixture(scope="module")
def peft(tok: Any) -> torch.nn.Module:
    return lora_policy(tok)


@pytest.fixture(scope="module")
def engine(peft: torch.nn.Module, tok: Any) -> Iterator[VLLMEngine]:
    e = VLLMEngine(peft, tok, engine_spec())
    yield e
    e.close()


def test_the_engine_samples_the_adapted_policy(
    engine: VLLMEngine, peft: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    assert engine.enable_lora and engine.policy_version == 0
    assert_engine_holds(engine, merged(peft), prompt_ids)
    no_adapter = copy.deepcopy(peft)  # the adapter matters: the base alone computes other log-probs
    with torch.no_grad():
        for name, p in no_adapter.named_parameters():
            if "lora_B" in name:
                p.zero_()
    done = engine.generate(prompt_ids, SamplingParams(temperature=0, max_new_tokens=12))
    assert max_logprob_gap(merged(no_adapter), done, 0.0) > 100 * TOL


def test_an_adapter_update_reaches_the_engine(
    engine: VLLMEngine, peft: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    new = lora_update(peft, prompt_ids)
    engine.update_weights(new, 3)
    assert engine.policy_version == 3
    assert_engine_holds(engine, merged(new), prompt_ids)
    done = engine.generate(prompt_ids, SamplingParams(temperature=0, max_new_tokens=12))
    assert max_logprob_gap(merged(peft), done, 0.0) > 100 * TOL  # no longer the old adapter
    engine.update_weights(peft, 4)
    assert_engine_holds(engine, merged(peft), prompt_ids)


def test_an_adapter_sync_that_does_nothing_fails_the_content_check(
    engine: VLLMEngine, peft: torch.nn.Module, prompt_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the mutated copy: the version moves, the LoRARequest stays the old one
    monkeypatch.setattr(
        engine, "load_adapter_dir", lambda path, version: setattr(engine, "_version", version)
    )
    new = lora_update(peft, prompt_ids)
    engine.update_weights(new, 5)
    assert engine.policy_version == 5
    with pytest.raises(AssertionError, match="engine log-probs differ"):
        assert_engine_holds(engine, merged(new), prompt_ids)


def test_an_adapter_missing_a_layer_is_refused(
    engine: VLLMEngine, peft: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    from peft import get_peft_model_state_dict

    weights = get_peft_model_state_dict(lora_update(peft, prompt_ids))
    dropped = next(k for k in weights if "layers.1.mlp.down_proj.lora_A" in k)
    del weights[dropped]
    version = engine.policy_version
    with pytest.raises(ConfigError, match=r"load_adapter\(version 9\): the payload does not match") as e:
        engine.load_adapter(weights, 9)
    assert dropped in str(e.value) and engine.policy_version == version
