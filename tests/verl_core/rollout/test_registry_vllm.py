"""make_engine by name; VLLMEngine without vllm (a clear error) and with it (GPU worker image only)."""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import torch

from verl_core.errors import ConfigError
from verl_core.models.loading import apply_lora
from verl_core.rollout import HFEngine, RolloutEngine, SamplingParams, VLLMEngine, make_engine
from verl_core.rollout.vllm import merged_state_dict, vllm_available

from .conftest import tiny_model

needs_vllm = pytest.mark.skipif(
    not vllm_available(), reason="vllm and a CUDA GPU are needed (GPU worker image: verl-flow[gpu])"
)


def test_make_engine_hf(model: Any, tok: Any) -> None:
    engine = make_engine("hf", model, tok, max_batch_size=8)
    assert isinstance(engine, HFEngine) and isinstance(engine, RolloutEngine)
    assert engine.max_batch_size == 8


def test_unknown_engine_name_lists_valid_names(model: Any, tok: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"^rollout.name: Unknown rollout engine 'sglang'. Valid names: hf, vllm\."
    ):
        make_engine("sglang", model, tok)


@pytest.mark.skipif(vllm_available(), reason="checks the error raised where vllm or a GPU is missing")
def test_vllm_without_vllm_is_a_clear_config_error(model: Any, tok: Any) -> None:
    # the lines of `verl-flow doctor` (verl_core.doctor.require), one per problem
    with pytest.raises(ConfigError) as e:
        make_engine("vllm", model, tok)
    lines = str(e.value).splitlines()
    if importlib.util.find_spec("vllm") is None:
        assert lines[0] == (
            "vllm: not installed (expected >=0.33, needed by rollout.name: 'vllm'); "
            "fix: pip install 'verl-flow[gpu]' in the GPU worker environment"
        )
    assert any(line.startswith(("torch CUDA build:", "CUDA available:")) for line in lines)
    with pytest.raises(ConfigError):
        VLLMEngine("some/model")


def test_merged_state_dict_equals_merge_and_unload_without_touching_the_model(tok: Any) -> None:
    peft = apply_lora(tiny_model(tok, seed=5), rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    before = {k: v.clone() for k, v in peft.state_dict().items()}
    merged = merged_state_dict(peft)
    reference = dict(copy.deepcopy(peft).merge_and_unload().named_parameters())
    assert merged.keys() == reference.keys()
    for name, weight in reference.items():
        torch.testing.assert_close(merged[name], weight, atol=1e-6, rtol=0)
    assert all(torch.equal(before[k], v) for k, v in peft.state_dict().items())  # untouched
    base_only = merged_state_dict(peft, base_only=True)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(base_only[q], merged[q])


@needs_vllm
def test_vllm_matches_hf_greedy_and_logprobs(tmp_path: Any, tok: Any, prompts: list[str]) -> None:
    model = tiny_model(tok, seed=6).eval()
    engine = VLLMEngine(model, tok, gpu_memory_utilization=0.2, dtype="float32")
    params = SamplingParams(n=2, temperature=0, max_new_tokens=8)
    got = engine.generate(prompts, params)
    ref = HFEngine(model, tok).generate(prompts, params)
    assert [(c.prompt_index, c.sample_index, c.response_ids) for c in got] == [
        (c.prompt_index, c.sample_index, c.response_ids) for c in ref
    ]
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@needs_vllm
def test_vllm_update_weights_sleep_and_wake(tok: Any, prompts: list[str]) -> None:
    engine = VLLMEngine(tiny_model(tok, seed=6), tok, gpu_memory_utilization=0.2, dtype="float32")
    other = tiny_model(tok, seed=7).eval()
    engine.sleep()
    engine.wake_up()
    engine.update_weights(other)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    got = [c.response_ids for c in engine.generate(prompts, params)]
    assert got == [c.response_ids for c in HFEngine(other, tok).generate(prompts, params)]


@needs_vllm
def test_vllm_seeded_sampling_is_deterministic(tok: Any, prompts: list[str]) -> None:
    engine = VLLMEngine(tiny_model(tok, seed=6), tok, gpu_memory_utilization=0.2)
    params = SamplingParams(n=3, max_new_tokens=8, seed=11)
    assert engine.generate(prompts, params) == engine.generate(prompts, params)


@needs_vllm
def test_vllm_split_calls_with_prompt_keys_sample_what_one_call_samples(tok: Any, prompts: list[str]) -> None:
    engine = VLLMEngine(tiny_model(tok, seed=6), tok, gpu_memory_utilization=0.2)
    params = SamplingParams(n=2, max_new_tokens=8, seed=11)
    whole = [c.response_ids for c in engine.generate(prompts, params)]
    first = [c.response_ids for c in engine.generate(prompts[2:], params, prompt_keys=[2, 3])]
    second = [c.response_ids for c in engine.generate(prompts[:2], params, prompt_keys=[0, 1])]
    assert second + first == whole


@needs_vllm
def test_vllm_load_weights_records_the_version(tok: Any, prompts: list[str]) -> None:
    engine = VLLMEngine(tiny_model(tok, seed=6), tok, gpu_memory_utilization=0.2, dtype="float32")
    other = tiny_model(tok, seed=7).eval()
    assert engine.policy_version == 0 and not engine.shares_weights
    engine.load_weights(merged_state_dict(other).items(), 5)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    assert engine.policy_version == 5
    got = [c.response_ids for c in engine.generate(prompts, params)]
    assert got == [c.response_ids for c in HFEngine(other, tok).generate(prompts, params)]
