"""A recording stand-in for the parts of vLLM the engine calls (``vllm.LLM``, ``vllm.SamplingParams``,
``vllm.inputs.TokensPrompt``, ``vllm.lora.request.LoRARequest``, ``vllm.platforms.current_platform``
and the NVML module vLLM imports), installed into ``sys.modules`` by :func:`install`: the pipeline's
environment has no vLLM. Every call lands in :attr:`FakeVLLM.calls` as ``(name, details)``."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class FakePlatform:
    """``vllm.platforms.current_platform``: a CUDA platform with sleep mode, or the CPU's."""

    cpu: bool = False
    device_type: str = "cuda"

    def is_cpu(self) -> bool:
        return self.cpu

    def is_sleep_mode_available(self) -> bool:
        return not self.cpu

    def device_id_to_physical_device_id(self, device_id: int) -> int:
        return device_id + 2  # CUDA_VISIBLE_DEVICES=2,3: logical 0 is physical 2


@dataclass
class FakeVLLM:
    platform: FakePlatform
    memory: dict[int, tuple[int, int]]  # physical device → (free, total) bytes, as NVML reads them
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def ops(self) -> list[str]:
        return [name for name, _ in self.calls]


def install(
    monkeypatch: pytest.MonkeyPatch, platform: FakePlatform, memory: dict[int, tuple[int, int]]
) -> FakeVLLM:
    """Put the fake ``vllm`` modules in ``sys.modules`` (and skip the engine's installed-vLLM check)."""
    fake = FakeVLLM(platform, memory)
    calls = fake.calls

    class LLM:
        def __init__(self, model: str, **kwargs: Any) -> None:
            calls.append(("LLM", {"model": model, **kwargs}))

        def get_tokenizer(self) -> Any:
            raise AssertionError("the tests pass a tokenizer")

        def generate(
            self, prompts: list[Any], params: list[Any], lora_request: Any = None, use_tqdm: bool = False
        ) -> list[Any]:
            calls.append(("generate", {"prompts": len(prompts), "lora": lora_request}))
            step = {7: types.SimpleNamespace(logprob=-0.5)}
            sample = types.SimpleNamespace(token_ids=[7], logprobs=[step], finish_reason="length", text="x")
            return [types.SimpleNamespace(outputs=[sample]) for _ in prompts]

        def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None:
            calls.append(("collective_rpc", {"method": method, **kwargs}))

        def reset_prefix_cache(self) -> None:
            calls.append(("reset_prefix_cache", None))

        def sleep(self, level: int) -> None:
            calls.append(("sleep", level))

        def wake_up(self) -> None:
            calls.append(("wake_up", None))

    class LoRARequest:
        def __init__(self, name: str, int_id: int, path: str) -> None:
            self.name, self.int_id, self.path = name, int_id, path

    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(free=memory[h][0], total=memory[h][1]),
    )
    modules = {
        "vllm": types.ModuleType("vllm"),
        "vllm.platforms": types.ModuleType("vllm.platforms"),
        "vllm.inputs": types.ModuleType("vllm.inputs"),
        "vllm.lora": types.ModuleType("vllm.lora"),
        "vllm.lora.request": types.ModuleType("vllm.lora.request"),
        "vllm.utils": types.ModuleType("vllm.utils"),
        "vllm.utils.import_utils": types.ModuleType("vllm.utils.import_utils"),
    }
    modules["vllm"].LLM = LLM  # type: ignore[attr-defined]
    modules["vllm"].SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    modules["vllm.platforms"].current_platform = platform  # type: ignore[attr-defined]
    modules["vllm.inputs"].TokensPrompt = dict  # type: ignore[attr-defined]
    modules["vllm.lora.request"].LoRARequest = LoRARequest  # type: ignore[attr-defined]
    modules["vllm.utils.import_utils"].import_pynvml = lambda: nvml  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr("verl_core.runtime.doctor.require_vllm", lambda needed_by: None)
    return fake
