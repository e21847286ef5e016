"""make_engine by name; the vLLM engine where neither vllm nor a vLLM environment is found (a clear
error). The engine itself is tested in the vLLM environment (tests/vllm) and through its subprocess
(test_vllm_process.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from verl_core.errors import ConfigError
from verl_core.models.loading import apply_lora
from verl_core.rollout import HFEngine, RolloutEngine, VLLMEngine, make_engine
from verl_core.rollout.vllm import merged_state_dict, vllm_available

from .conftest import tiny_model, vllm_spec


def test_make_engine_hf(model: Any, tok: Any) -> None:
    engine = make_engine("hf", model, tok, max_batch_size=8)
    assert isinstance(engine, HFEngine) and isinstance(engine, RolloutEngine)
    assert engine.max_batch_size == 8


def test_unknown_engine_name_lists_valid_names(model: Any, tok: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"^rollout.name: Unknown rollout engine 'sglang'. Valid names: auto, hf, vllm\."
    ):
        make_engine("sglang", model, tok)


def test_vllm_without_vllm_or_its_environment_is_a_clear_config_error(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    if vllm_available():
        pytest.skip("vllm imports in this environment: the engine is built in-process")
    monkeypatch.delenv("VERL_FLOW_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)  # no .venv-vllm in the working directory
    fake_source = tmp_path / "a" / "b" / "c"  # the project tree without .venv-vllm beside it
    monkeypatch.setattr("verl_core.rollout.vllm_process.Path.resolve", lambda self: fake_source)
    with pytest.raises(ConfigError, match=r"^rollout.name: 'vllm': vLLM is not importable here and no"):
        make_engine("vllm", model, tok, spec=vllm_spec(), vllm_python="auto")
    with pytest.raises(ConfigError, match="vllm: not installed"):
        VLLMEngine("some/model", None, vllm_spec())  # in-process: doctor's line, both fixes


def test_merged_state_dict_equals_merge_and_unload_without_touching_the_model(tok: Any) -> None:
    peft = apply_lora(tiny_model(tok, seed=5), rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    before = {k: v.clone() for k, v in peft.state_dict().items()}
    merged = merged_state_dict(peft)
    # every state-dict entry, the tied lm_head.weight too (vLLM's CPU backend needs it sent)
    reference = copy.deepcopy(peft).merge_and_unload().state_dict()
    assert "lm_head.weight" in merged
    assert merged.keys() == reference.keys()
    for name, weight in reference.items():
        torch.testing.assert_close(merged[name], weight, atol=1e-6, rtol=0)
    assert all(torch.equal(before[k], v) for k, v in peft.state_dict().items())  # untouched
    base_only = merged_state_dict(peft, base_only=True)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(base_only[q], merged[q])


def test_auto_picks_the_measured_engine_for_the_device(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl_core.rollout import registry

    # CPU: the HF engine (its loop measured 2.6x vLLM's tokens/s at the quickstart shape)
    assert registry.AUTO_ENGINE["cpu"] == "hf"
    kwargs = {"hf": {"max_batch_size": 8}, "vllm": {"vllm_python": "/nonexistent/python"}}
    engine = make_engine("auto", model, tok, **kwargs)
    assert isinstance(engine, HFEngine) and engine.max_batch_size == 8
    # where the table says vllm but vLLM is not available: the hf engine, not an error
    monkeypatch.setitem(registry.AUTO_ENGINE, "cpu", "vllm")
    monkeypatch.setattr(registry, "_vllm_ready", lambda python: False)
    assert isinstance(make_engine("auto", model, tok, **kwargs), HFEngine)
    built: dict[str, Any] = {}
    monkeypatch.setattr(registry, "_vllm_ready", lambda python: True)
    monkeypatch.setitem(registry.ENGINES._entries, "vllm", lambda m, t, **kw: built.setdefault("vllm", kw))
    make_engine("auto", model, tok, **kwargs, env={"CUDA_VISIBLE_DEVICES": "1"})
    # the vLLM engine's own arguments, and its environment (its devices under torchrun)
    assert built == {"vllm": {"vllm_python": "/nonexistent/python", "env": {"CUDA_VISIBLE_DEVICES": "1"}}}
