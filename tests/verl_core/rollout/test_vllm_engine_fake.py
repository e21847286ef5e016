"""The in-process vLLM engine against a recording fake of vLLM (``fake_vllm.py``): what it passes to
``vllm.LLM`` (the spec's dtype, memory vLLM's start check accepts, the LoRA rank vLLM allows), the call
order around sleep (sleep → wake_up → reload → generate, nothing where the platform has no sleep
mode), no CUDA touched in the front-end process, and old adapter directories removed."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_core.models.loading import apply_lora
from verl_core.rollout import SamplingParams
from verl_core.rollout.vllm import VLLMEngine
from verl_core.rollout.vllm_spec import GIB, VLLMSpec

from .conftest import tiny_model
from .fake_vllm import FakePlatform, install

SPEC = VLLMSpec(
    dtype="bfloat16", trust_remote_code=False, tensor_parallel_size=2, gpu_memory_utilization=0.5,
    kv_cache_gib=4.0, cpu_kv_cache_gib=1.0, enforce_eager=True, max_model_len=None, weight_sync_bucket_mb=1,
)  # fmt: skip
# NVML's view of the two physical GPUs the engine's logical 0 and 1 map to (2, 3): the trainer holds
# 50 of 80 GiB on GPU 3
MEMORY = {2: (70 * GIB, 80 * GIB), 3: (30 * GIB, 80 * GIB)}


def test_vllm_gets_the_compute_dtype_and_memory_its_start_check_accepts(
    monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module, tok: Any
) -> None:
    fake = install(monkeypatch, FakePlatform(), MEMORY)
    engine = VLLMEngine(model, tok, SPEC)
    (name, kwargs), *_ = fake.calls
    assert name == "LLM"
    assert kwargs["dtype"] == "bfloat16"  # the spec's (the trainer's compute dtype), not model.dtype
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["enable_sleep_mode"]
    # KV cache by bytes, and a utilization the tighter GPU (3: 30 of 80 GiB free) satisfies:
    # floor(100 × (30 - 1) / 80) / 100 = 0.36 (the old kwargs had none: vLLM's 0.92 → 73.6 GiB)
    assert kwargs["kv_cache_memory_bytes"] == 4 * GIB
    assert kwargs["gpu_memory_utilization"] == 0.36
    assert "enable_chunked_prefill" not in kwargs  # CUDA's generator has an offset
    assert engine.tensor_parallel_size == 2 and engine.bucket_bytes == 1 << 20


@pytest.mark.parametrize("cpu", [False, True], ids=["cuda-sleep-mode", "cpu-no-sleep-mode"])
def test_sleep_then_wake_before_the_reload_then_generate(
    cpu: bool, monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module, tok: Any
) -> None:
    platform = FakePlatform(cpu=cpu, device_type="cpu" if cpu else "cuda")
    fake = install(monkeypatch, platform, MEMORY)
    engine = VLLMEngine(model, tok, SPEC)
    assert engine.can_sleep is not cpu
    engine.wake_up()  # awake: nothing to restore
    engine.sleep()  # the trainer's turn
    engine.sleep()  # asleep already
    engine.load_weights(model.state_dict().items(), 1)  # the new policy
    engine.generate(["Q: 1 + 2"], SamplingParams(max_new_tokens=1, seed=0))
    reload = ["collective_rpc", "reset_prefix_cache", "generate"]
    # with sleep mode: offloaded once, woken before the reload (its pages are unmapped while asleep);
    # the CPU platform has none: neither is called
    assert fake.ops()[1:] == (reload if cpu else ["sleep", "wake_up", *reload])
    assert ("sleep", 1) in fake.calls or cpu  # level 1: the weights are kept (a LoRA base stays)
    assert engine.policy_version == 1
    engine.sleep()
    engine.generate(["Q: 1 + 2"], SamplingParams(max_new_tokens=1, seed=0))  # wakes first
    assert fake.ops()[-2:] == (["generate", "generate"] if cpu else ["wake_up", "generate"])


def test_no_cuda_in_the_front_end_process(
    monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module, tok: Any
) -> None:
    """Deciding chunked prefill builds no CUDA generator (the old code built
    ``torch.Generator(device="cuda")``: a CUDA context on GPU 0, and vLLM's workers spawned)."""
    real = torch.Generator
    built: list[str] = []

    def generator(device: str | torch.device = "cpu") -> torch.Generator:
        built.append(str(device))
        if torch.device(device).type != "cpu":
            raise AssertionError(f"a {device} generator built in the front-end process")
        return real(device=device)

    def no_cuda() -> None:
        raise AssertionError("CUDA initialised in the front-end process")

    monkeypatch.setattr(torch, "Generator", generator)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    monkeypatch.setattr(torch.cuda, "init", no_cuda)
    for platform in (FakePlatform(), FakePlatform(cpu=True, device_type="cpu")):
        fake = install(monkeypatch, platform, MEMORY)
        VLLMEngine(model, tok, SPEC)
        chunked = fake.calls[0][1].get("enable_chunked_prefill", True)
        assert chunked is not platform.cpu  # off on CPU only: its generator has no offset
    assert all(d == "cpu" for d in built)
    assert not torch.cuda.is_initialized()


def test_a_lora_policy_gets_vllms_rank_and_old_adapter_directories_go(
    monkeypatch: pytest.MonkeyPatch, tok: Any
) -> None:
    fake = install(monkeypatch, FakePlatform(), MEMORY)
    peft = apply_lora(tiny_model(tok, seed=5), rank=8, alpha=16, dropout=0.0, target_modules="all-linear")
    engine = VLLMEngine(peft, tok, dataclasses.replace(SPEC, tensor_parallel_size=1))
    llm = fake.calls[0][1]
    assert llm["enable_lora"] and llm["max_lora_rank"] == 8  # the old max(64, r) padded r=8 to 64
    for version in (1, 2, 3):
        engine.update_weights(peft, version)
    root = Path(engine._adapter_root)
    # four adapters sent (the first at start): only the current one and the one before stay on disk
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("adapter-")) == [
        "adapter-3",
        "adapter-4",
    ]
    assert engine._lora.path == os.path.join(root, "adapter-4") and engine.policy_version == 3
    engine.generate(["Q: 1 + 2"], SamplingParams(max_new_tokens=1, seed=0))
    assert fake.calls[-1] == ("generate", {"prompts": 1, "lora": engine._lora})
